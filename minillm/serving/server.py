"""The OpenAI-compatible HTTP app over the continuous-batching engine: routes, request checks, streaming.

`minillm.serving.launch` builds the engine and this app and starts them (`python -m minillm.serve`
from the command line, `BackgroundServer` in notebooks and tests); the plumbing any such server
needs (body limit, server-sent events, JSON errors) is `minillm.serving.http`, and how engine
events become OpenAI's choices is `minillm.serving.choices`:

    python -m minillm.serve --model default --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "default", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Any OpenAI client works unchanged (`OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`):

    POST /v1/completions        text in, text out (prompt: text, texts, or token ids)
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models             the one model served
    GET  /health                200 while the server answers
    GET  /stats                 the engine's counters: requests, blocks, forwards (not OpenAI's)
    GET  /metrics               Prometheus metrics: queue, batch, KV blocks, tokens, latencies

Streaming is server-sent events: `data: {json}` chunks as tokens become final text, a
usage chunk when `stream_options.include_usage` asks for it, then `data: [DONE]`. With
`logprobs`, each chunk carries the logprobs of the tokens it carries; with `echo`, the
first chunk of a choice begins with its prompt. `n` choices share their prompt's blocks
(computed once); `use_beam_search` (vLLM's extra) returns the n best beams instead, not
streamed (`minillm.serving.beams`).

What keeps one bad client from hurting the others: every request body is checked
before any model work, and a bad one is answered with OpenAI's JSON error and a 4xx
status (never a traceback); bodies over `--max-body-mb` are refused unread; at most
`--max-waiting` requests queue for a place in the batch, beyond that the answer is
503 with Retry-After; a request running longer than `--request-timeout` ends as if
it had hit max_tokens; a client that disconnects has its request aborted and its KV
blocks freed at once. The server binds to 127.0.0.1 unless told otherwise: it has no
authentication, so exposing it is a decision to make on purpose.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..decoding.limits import Cancelled, PatternError
from ..decoding.outputs import GenerationEvent, check_prompts
from ..decoding.sampling import check_logit_bias
from ..decoding.settings import SamplingError
from ..decoding.structured import token_index
from ..runtime.engine import Engine
from .async_engine import AsyncEngine, EngineFailed, QueueFull
from .beams import beam_search, beam_settings
from .choices import Choices
from .http import BodyLimit, api_response, sse, validation_error
from .metrics import ServerMetrics
from .openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingParameters,
    chat_choice,
    chat_delta,
    chat_logprobs,
    chat_prompt,
    completion_choice,
    completion_logprobs,
    completion_prompts,
    envelope,
    finish_reason,
    max_new_tokens,
    new_id,
    refuse_unsupported,
    sampling_config,
    usage,
)
from .tools import Tools, turns_with_tools

ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /health, /stats, /metrics"


class OpenAIServer:
    """The routes' logic; `create_app` wires it to FastAPI."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int, request_timeout: float):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.request_timeout = max_model_len, request_timeout
        self.compiles: set[threading.Event] = set()  # one per schema compile under way: set to stop it
        self.stopping = False

    def stop_compiling(self) -> None:
        """The server is stopping (SIGTERM): every compile under way stops at its next check and its request is
        answered 503 at once, so no request is left for the shutdown to cancel; later ones are refused. Safe from
        a signal handler: it only sets events."""
        self.stopping = True
        for cancelled in list(self.compiles):
            cancelled.set()

    async def submit(self, body: SamplingParameters, prompts: list[list[int]], tools: Tools | None = None) -> Choices:
        """Check everything, then add one engine request per (prompt, choice): all of them or none."""
        self.check_body(body)
        options = body.logprob_options()
        scoring_only = options.get("prompt_top_logprobs") is not None and body.requested_max_tokens() == 0
        flat, configs = [], []
        for prompt in prompts:
            budget = max_new_tokens(body, len(prompt), self.max_model_len)
            for choice in range(body.n):
                flat.append(prompt)
                configs.append(sampling_config(body, 1 if scoring_only else budget, choice, tools))
        vocab_size = self.check_prompts(prompts)
        try:
            check_logit_bias(configs[0], vocab_size)
        except SamplingError as e:
            raise APIError(400, str(e), param="logit_bias") from None
        echo = [self.tokenizer.decode(prompt) for prompt in flat] if getattr(body, "echo", False) else None
        if configs[0].constraint is not None:  # compiled once per schema, off the event loop; then cached
            await self.compile_constraint(configs[0].constraint)
        with engine_errors():
            return Choices(await self.engine.submit(flat, configs, **options), flat, sum(map(len, prompts)),
                           options["top_logprobs"] is not None, echo, scoring_only)

    def check_body(self, body: SamplingParameters) -> None:
        """The model asked for is this one, and no parameter the server does not implement is set (else a 4xx)."""
        if body.model is not None:
            check_model_name(body.model, self.model_name)
        refuse_unsupported(body)

    def check_prompts(self, prompts: list[list[int]]) -> int:
        """Before the queue: a prompt too long or a token id outside the vocabulary is the client's to fix (400),
        whether or not the server is busy. Returns the vocabulary's size."""
        vocab_size = self.engine.engine.model.config.vocab_size
        try:
            check_prompts(prompts, self.max_model_len, vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        return vocab_size

    async def compile_constraint(self, constraint: tuple[str, str]) -> None:
        """Build the schema's automaton and token index now, on a worker thread (the engine's requests find it
        cached); a schema outside the supported subset, or past the automaton's limits, is a 400 naming the
        keyword. The compile stops as soon as nobody waits for it (the client left, the server is stopping):
        a thread cannot be killed, so it is told, and it checks between states."""
        vocab_size = self.engine.engine.model.config.vocab_size
        cancelled = threading.Event()
        self.compiles.add(cancelled)
        try:
            if self.stopping:
                raise Cancelled("the server is stopping")
            await asyncio.to_thread(token_index, *constraint, self.tokenizer, vocab_size, cancelled)
        except PatternError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from None
        except Cancelled:
            raise APIError(503, "the server is stopping: send the request again once it is back",
                           type="server_overloaded") from None
        finally:
            cancelled.set()  # a no-op once it has finished; otherwise the thread stops at its next check
            self.compiles.discard(cancelled)

    async def events(self, choices: Choices, request: Request):
        """(choice index, piece) until every choice has finished; ends overdue choices with "length".

        The caller aborts `choices.submitted.ids` in a `finally` (a no-op for finished ones),
        which is what frees the blocks of a client that went away.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout
        left = set(choices.submitted.ids)
        while left:
            remaining = deadline - loop.time()
            if remaining <= 0:  # the time limit: end what is left as max_tokens would
                self.engine.abort(left)
                for request_id in sorted(left):
                    yield choices.record(GenerationEvent(request_id, [], "", "length"))
                return
            try:
                item = await asyncio.wait_for(choices.submitted.events.get(), min(remaining, 1.0))
            except TimeoutError:
                if await request.is_disconnected():  # nobody streams to it: a non-streaming client left
                    return
                continue
            if isinstance(item, EngineFailed):
                raise engine_failed(item)
            if item.finish_reason is not None:
                left.discard(item.row)
            yield choices.record(item)

    async def complete(self, body, prompts: list[list[int]], request: Request, kind: str, tools: Tools | None = None):
        """The non-streaming answer, or a StreamingResponse; kind is "text_completion" or "chat.completion"."""
        if body.use_beam_search:
            return await self.beam_answer(body, prompts, kind)
        choices = await self.submit(body, prompts, tools)
        response_id = new_id("cmpl" if kind == "text_completion" else "chatcmpl")
        if body.stream:
            chunks = (self.completion_chunks(body, choices, request, response_id) if kind == "text_completion"
                      else self.chat_chunks(body, choices, request, response_id, tools))
            return StreamingResponse(sse(chunks, lambda: self.engine.abort(choices.submitted.ids)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _ in self.events(choices, request):
                pass
        finally:
            self.engine.abort(choices.submitted.ids)
        if kind == "text_completion":
            answers = [completion_choice(i, whole.text, whole.finish_reason,
                                         completion_logprobs(whole.token_ids, whole.logprobs, self.tokenizer)
                                         if choices.with_logprobs else None)
                       for i, whole in enumerate(choices.whole)]
        else:
            answers = [chat_choice(i, whole.text, whole.finish_reason,
                                   chat_logprobs(whole.logprobs, self.tokenizer) if choices.with_logprobs else None,
                                   tools.parse_call(whole.text) if tools else None)
                       for i, whole in enumerate(choices.whole)]
        return envelope(kind, response_id, self.model_name, answers, choices.usage())

    async def beam_answer(self, body, prompts: list[list[int]], kind: str) -> dict:
        """`use_beam_search`: each prompt's n best beams, prompt after prompt (`minillm.serving.beams`)."""
        self.check_body(body)
        vocab_size = self.check_prompts(prompts)
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        answers, completion_tokens = [], 0
        for prompt in prompts:
            settings = beam_settings(body, max_new_tokens(body, len(prompt), self.max_model_len), self.tokenizer)
            with engine_errors():
                out = await beam_search(self.engine, prompt, settings, vocab_size, self.tokenizer, deadline)
            for row in out.rows:
                choice = completion_choice if kind == "text_completion" else chat_choice
                answers.append(choice(len(answers), row.text, row.finish_reason))
                completion_tokens += len(row.token_ids)
        return envelope(kind, new_id("cmpl" if kind == "text_completion" else "chatcmpl"), self.model_name, answers,
                        usage(sum(map(len, prompts)), completion_tokens))

    async def completion_chunks(self, body, choices: Choices, request: Request, response_id: str):
        text_offsets = [0] * len(choices.whole)  # where each choice's next token begins (logprobs' text_offset)
        async for i, piece in self.events(choices, request):
            logprobs = None
            if choices.with_logprobs:
                logprobs = completion_logprobs(piece.token_ids, piece.logprobs, self.tokenizer, text_offsets[i])
                text_offsets[i] += sum(map(len, logprobs["tokens"]))
            if piece.text or piece.finish_reason or (logprobs and piece.token_ids):
                yield envelope("text_completion", response_id, self.model_name,
                               [completion_choice(i, piece.text, piece.finish_reason, logprobs)])
        if body.include_usage():
            yield envelope("text_completion", response_id, self.model_name, [], choices.usage())

    async def chat_chunks(self, body, choices: Choices, request: Request, response_id: str, tools: Tools | None):
        """Chat deltas as the tokens become text. With tools, a choice that is (or, under "auto", begins as) a
        call is held back and sent as one `tool_calls` delta once whole: its arguments are only valid JSON then."""
        kind = "chat.completion.chunk"
        held: dict[int, str] = {}  # choice -> the call's text so far
        for i in range(len(choices.whole)):
            yield envelope(kind, response_id, self.model_name, [chat_delta(i, {"role": "assistant", "content": ""})])
            if tools and not tools.text_allowed:
                held[i] = ""
        async for i, piece in self.events(choices, request):
            if tools and tools.text_allowed and choices.whole[i].text == piece.text and piece.text.startswith("{"):
                held[i] = ""  # the first text of an "auto" reply: "{" begins a call (the mask allows nothing else)
            if i in held:
                held[i] += piece.text
                if piece.finish_reason:
                    call = tools.parse_call(held[i])
                    delta = {"tool_calls": [{"index": 0, **call}]} if call else {"content": held[i]}
                    yield envelope(kind, response_id, self.model_name, [chat_delta(i, delta)])
                    reason = "tool_calls" if call else finish_reason(piece.finish_reason)
                    yield envelope(kind, response_id, self.model_name, [{**chat_delta(i, {}), "finish_reason": reason}])
                continue
            if piece.text or (choices.with_logprobs and piece.token_ids):
                logprobs = chat_logprobs(piece.logprobs, self.tokenizer) if choices.with_logprobs else None
                yield envelope(kind, response_id, self.model_name, [chat_delta(i, {"content": piece.text}, None,
                                                                               logprobs)])
            if piece.finish_reason:
                yield envelope(kind, response_id, self.model_name, [chat_delta(i, {}, piece.finish_reason)])
        if body.include_usage():
            yield envelope(kind, response_id, self.model_name, [], choices.usage())


def create_app(engine: AsyncEngine, tokenizer, *, model_name: str, max_model_len: int, metrics: ServerMetrics,
               request_timeout: float = 600.0, max_body_bytes: int = 2**20) -> FastAPI:
    """The FastAPI app serving `engine` (already started) under OpenAI's routes; `metrics` is fed by the engine's
    thread (`AsyncEngine(on_finish=metrics.request_finished)`) and read at /metrics."""
    server = OpenAIServer(engine, tokenizer, model_name, max_model_len, request_timeout)
    app = FastAPI(title="minillm", summary="An OpenAI-compatible server over minillm's continuous-batching engine",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return api_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        return api_response(validation_error(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        if error.status_code == 404:
            message = f"no route {request.url.path}: this server answers {ROUTES}"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}: see the OpenAI API reference"
        else:
            message = str(error.detail)
        return api_response(APIError(error.status_code, message))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):  # a bug: say so in JSON, keep serving
        return api_response(APIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = completion_prompts(body.prompt, tokenizer)
        return await server.complete(body, prompts, request, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        tools = Tools.from_request(body.tools, body.tool_choice)
        prompt = chat_prompt(turns_with_tools([message.turn() for message in body.messages], tools), tokenizer)
        return await server.complete(body, [tokenizer.encode(prompt)], request, "chat.completion", tools)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_name, created, max_model_len)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model_name(name, model_name)
        return model_card(model_name, created, max_model_len)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return {**await engine.call(engine_stats), "requests_aborted": engine.aborted}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(await engine.call(engine_stats)), media_type=CONTENT_TYPE_LATEST)

    app.state.openai = server  # `python -m minillm.serve`'s SIGTERM handler stops its compiles
    return app


@contextmanager
def engine_errors():
    """What handing requests to the engine raises, as the client sees it: a full queue is 503 with Retry-After, a
    lasting engine failure 503 (`engine_failed`), the engine's own checks (a pool too small) 400."""
    try:
        yield
    except QueueFull as e:
        raise APIError(503, f"the server is busy: {e}", type="server_overloaded", headers={"Retry-After": "1"}) \
            from None
    except EngineFailed as e:  # only a lasting failure is raised here: the engine cannot step again
        raise engine_failed(e) from None
    except ValueError as e:  # the engine's own checks: token ids outside the vocabulary, a pool too small
        raise APIError(400, " ".join(str(e).split())) from None


def engine_failed(error: EngineFailed) -> APIError:
    """A failed step as the client sees it: a bug in a step is 500 (the next request may well work); an engine that
    cannot step again (a tensor-parallel rank is gone) is 503, saying why, for every request until a restart."""
    if error.lasting:
        return APIError(503, f"the server cannot compute: {error}; restart it", type="server_error")
    return APIError(500, str(error), type="server_error")


def check_model_name(asked: str, served: str) -> None:
    if asked != served:
        raise APIError(404, f"model {asked!r} does not exist: this server serves {served!r} (GET /v1/models lists it)",
                       param="model", code="model_not_found")


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "minillm", "max_model_len": max_model_len}


def engine_stats(engine: Engine) -> dict:
    """What the soak test reads to prove nothing leaked: requests held and free blocks."""
    m = engine.manager
    return {"requests_running": len(engine.scheduler.running), "requests_waiting": len(engine.scheduler.waiting),
            "requests_held": len(engine.requests), "blocks_total": m.num_blocks, "blocks_free": m.num_free,
            "forward_passes": engine.forward_passes, "prefix_hit_rate": engine.prefix_hit_rate}
