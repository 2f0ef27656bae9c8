"""OpenAI's HTTP API as data: request bodies in, minillm settings out, response bodies back.

Nothing here touches the network or the engine, so every mapping is checkable on its
own. The server (`minillm.serving.server`) glues it to the engine.

Requests. Bodies are read with pydantic (types), then minillm's own checks (ranges):
`SamplingConfig` names the bad field, and the name is translated back to OpenAI's
(`max_new_tokens` -> `max_tokens`), so a client is told about the parameter it sent.

    OpenAI                          minillm (transformers' names)
    max_tokens / max_completion_tokens   max_new_tokens
    temperature (default 1)         do_sample=True, temperature (0 = greedy)
    top_p, seed, stop               top_p, seed, stop
    presence_penalty, frequency_penalty  the same (OpenAI's definitions, lesson 04)
    top_k, min_p, repetition_penalty     extras, as vLLM accepts them
    ignore_eos                      extra: eos_token_id=() (exact lengths, for load tests)
    n                               n requests; choice i samples with seed + i
    chat logprobs, top_logprobs     the engine's top_logprobs (0-20): each token's logprob and the likeliest
    completions logprobs            the same (0-5), in the legacy shape
    completions echo                the prompt before the completion; with logprobs, the engine's
                                    prompt_top_logprobs too (the prompt's first token gets null)
    chat response_format            json_object: json_schema={"type": "object"}; json_schema: its "schema"
                                    (structured output, lesson 18; a keyword outside the subset is a 400
                                    naming it)
    logit_bias                      logit_bias: {token id: -100..100}, added before every other processor
    chat tools, tool_choice         the reply constrained to a call or text (`minillm.serving.tools`)

OpenAI samples by default (temperature 1); send `temperature: 0` for greedy decoding.
Logprobs are those of the distribution each token was drawn from (`minillm.decoding.logprobs`);
JSON has no -inf, so a token the sampler could not draw reports vLLM's floor, -9999.0.
`echo` with `logprobs` scores a text: lm-evaluation-harness reads a prompt's log-likelihood
from any such server with `echo: true, logprobs: 1, max_tokens: 1` (older versions send
`max_tokens: 0`, which scores without generating). Echoed prompt logprobs run the LM head at
every prompt position and compute the whole prompt, never reading it from the prefix cache.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a
4xx status for anything the client can fix.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..decoding.json_schema import JSON_OBJECT_SCHEMA
from ..decoding.logprobs import TokenLogprobs
from ..decoding.outputs import check_fits_context
from ..decoding.sampling import SamplingConfig
from ..decoding.settings import SamplingError

OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # minillm field -> the parameter the client sent
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # minillm -> OpenAI
MAX_CHOICES = 16  # n above this is refused: one request must not fill the batch alone
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI allows
LOGPROB_FLOOR = -9999.0  # what a -inf logprob reports (vLLM's value): JSON has no infinity


class APIError(Exception):
    """An error response: HTTP status, OpenAI's error type, the offending parameter, a message naming the fix."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------- request bodies

class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingParameters(BaseModel):
    """What completions and chat share. Unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the one model this server holds
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_k: int | None = None  # extras: not in OpenAI's API
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False  # an extra (vLLM's too): exact output lengths for benchmarks
    use_beam_search: bool = False  # extras, as vLLM's server has them: n beams, the n best returned
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingParameters):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def logprob_options(self) -> dict:
        """The engine's logprobs settings: `logprobs` likeliest tokens beside each token; with echo, the prompt's."""
        check_logprob_count("logprobs", self.logprobs, MAX_COMPLETION_LOGPROBS)
        return {"top_logprobs": self.logprobs, "prompt_top_logprobs": self.logprobs if self.echo else None}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list | None = None  # an assistant turn that called tools (minillm.serving.tools)
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"this server reads text: a content part of type {part.type!r} cannot be "
                                        'read; send {"type": "text", "text": ...} parts only', param="messages")
            return "".join(part.text for part in self.content)
        return self.content or ""

    def turn(self) -> dict:
        """The message as the chat template reads it: OpenAI's "developer" role is the system role of older models
        and of every template here; an assistant turn that called tools holds the calls' JSON (one per line), as
        the model was asked to write them."""
        content = self.text()
        if self.tool_calls:
            content = "\n".join(filter(None, [content, *map(call_json, self.tool_calls)]))
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


def call_json(call) -> str:
    """One earlier tool call as `{"name": ..., "arguments": {...}}`."""
    function = call.get("function") if isinstance(call, dict) else None
    try:
        arguments = json.loads(function.get("arguments") or "{}") if isinstance(function, dict) else None
    except (TypeError, ValueError):
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, "an assistant message's tool_calls must each be {\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"arguments\": a JSON object as text}}", param="messages")
    return json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)


class ChatCompletionRequest(SamplingParameters):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None  # functions the model may call (minillm.serving.tools)
    tool_choice: str | dict | None = None  # "none", "auto" (the default with tools), "required", or one function
    response_format: dict | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def output_schema(self) -> str | None:
        """The JSON schema (as JSON text) `response_format` asks the reply to match, or None for free text."""
        fmt = self.response_format
        if fmt is None or fmt == {"type": "text"}:
            return None
        kind = fmt.get("type")
        if kind == "json_object":
            return json.dumps(JSON_OBJECT_SCHEMA)
        if kind != "json_schema":
            raise APIError(400, f'response_format type {kind!r} is invalid: must be "text", "json_object" or '
                                f'"json_schema"', param="response_format")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise APIError(400, 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                '"schema": {...}}', param="response_format")
        schema = spec.get("schema", JSON_OBJECT_SCHEMA)
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return json.dumps(schema)

    def logprob_options(self) -> dict:
        """The engine's logprobs settings: with `logprobs: true`, `top_logprobs` (default 0) likeliest tokens."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, 'top_logprobs needs logprobs: add "logprobs": true to the request',
                           param="top_logprobs")
        check_logprob_count("top_logprobs", self.top_logprobs, MAX_TOP_LOGPROBS)
        return {"top_logprobs": (self.top_logprobs or 0) if self.logprobs else None}


def check_logprob_count(name: str, count: int | None, most: int) -> None:
    if count is not None and not 0 <= count <= most:
        raise APIError(400, f"{name}={count} is invalid: must be between 0 and {most}", param=name)


def refuse_unsupported(body: SamplingParameters) -> None:
    """Parameters minillm does not implement: refused by name, never silently ignored."""
    unsupported = {
        "best_of": getattr(body, "best_of", None) not in (None, 1),
        "suffix": getattr(body, "suffix", None) is not None,
    }
    for name, used in unsupported.items():
        if used:
            raise APIError(400, f"{name} is not supported by this server: remove it from the request", param=name)
    if not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n={body.n} is invalid: must be between 1 and {MAX_CHOICES}", param="n")


def chat_prompt(turns: list[dict], tokenizer) -> str:
    """The conversation (`Message.turn`s) through the model's chat template, ending where the assistant's reply
    begins."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model has no chat template: use /v1/completions with a plain prompt",
                       param="messages")
    return tokenizer.apply_chat_template(turns, add_generation_prompt=True)


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """OpenAI's four prompt forms (text, texts, token ids, lists of token ids) -> token ids per prompt."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt is empty: give at least one prompt", param="prompt")
    return [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]


def max_new_tokens(body: SamplingParameters, prompt_tokens: int, max_model_len: int) -> int:
    """The request's token budget, or a 400 when prompt and answer cannot fit the context (as OpenAI does)."""
    if prompt_tokens == 0:
        raise APIError(400, "the prompt is empty: give it at least one token", param="prompt")
    if prompt_tokens >= max_model_len:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens, but this model's maximum context length is "
                            f"{max_model_len} tokens: shorten the prompt", code="context_length_exceeded")
    requested = body.requested_max_tokens()
    if requested is None:
        return max_model_len - prompt_tokens
    if requested < 0:
        raise APIError(400, f"max_tokens={requested} is invalid: must be >= 0", param="max_tokens")
    try:
        check_fits_context(prompt_tokens, requested, max_model_len, budget="max_tokens")
    except ValueError as e:
        raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
    return requested


def sampling_config(body: SamplingParameters, max_new: int, choice: int = 0, tools=None) -> SamplingConfig:
    """minillm's settings for one choice of the request (see the module docstring for the mapping); `tools`
    (`minillm.serving.tools.Tools`, or None) constrains the reply to a call, or to a call or text."""
    temperature = 1.0 if body.temperature is None else body.temperature
    given = {"top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
             "repetition_penalty": body.repetition_penalty, "presence_penalty": body.presence_penalty,
             "frequency_penalty": body.frequency_penalty}
    schema = body.output_schema() if isinstance(body, ChatCompletionRequest) else None
    if tools is not None:
        if schema is not None:
            raise APIError(400, "response_format and tools both shape the reply: send one of them",
                           param="response_format")
        schema, given["or_text"] = json.dumps(tools.call_schema()), tools.text_allowed
    try:
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}  # JSON's keys are strings
    except ValueError:
        raise APIError(400, f"logit_bias={body.logit_bias!r} is invalid: its keys must be token ids (integers "
                            "as strings, e.g. {\"50256\": -100})", param="logit_bias") from None
    try:
        return SamplingConfig(max_new_tokens=max_new, stop=body.stop or (), eos_token_id=() if body.ignore_eos else None,
                              do_sample=True, temperature=temperature, json_schema=schema, logit_bias=bias,
                              seed=None if body.seed is None else body.seed + choice,
                              **{name: value for name, value in given.items() if value is not None})
    except SamplingError as e:
        name = OPENAI_NAMES.get(e.field, e.field)
        raise APIError(400, f"{name}={e.value!r} is invalid: must be {e.allowed}", param=name) from None


# ---------------------------------------------------------------------------------------------- response bodies

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(minillm_reason: str | None) -> str | None:
    return None if minillm_reason is None else FINISH_REASONS.get(minillm_reason, "length")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def chat_choice(index: int, text: str, reason: str | None, logprobs: dict | None = None,
                tool_call: dict | None = None) -> dict:
    """One chat choice: its text, or the tool call it is (`minillm.serving.tools`)."""
    if tool_call is not None:
        return {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                "logprobs": logprobs, "finish_reason": "tool_calls"}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason(reason)}


def chat_delta(index: int, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def json_logprob(logprob: float) -> float:
    """JSON has no -inf (a token the sampler could not draw): LOGPROB_FLOOR stands for it."""
    return max(logprob, LOGPROB_FLOOR)


def chat_logprobs(reports: list[TokenLogprobs], tokenizer) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}]}.

    A token's text is what it decodes to alone; its bytes are its own (part of a character, maybe).
    """
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([token_id]), "logprob": json_logprob(logprob),
                "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in reports]}


def completion_logprobs(token_ids: list[int], reports: list[TokenLogprobs | None], tokenizer,
                        text_offset: int = 0) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs and text_offset, one entry per token.

    A None report (an echoed prompt's first token, which nothing predicts) gives nulls. Each top_logprobs dict
    holds the token itself and the likeliest tokens (so up to logprobs + 1 entries, as OpenAI says). text_offset:
    where each token's text begins, the first at `text_offset` (a stream's chunks continue where the last ended).
    """
    tokens = [tokenizer.decode([t]) for t in token_ids]

    def likeliest(report: TokenLogprobs) -> dict:
        top = {tokenizer.decode([report.token_id]): json_logprob(report.logprob)}
        for token_id, logprob in report.top:
            top.setdefault(tokenizer.decode([token_id]), json_logprob(logprob))
        return top

    return {"tokens": tokens,
            "token_logprobs": [None if r is None else json_logprob(r.logprob) for r in reports],
            "top_logprobs": [None if r is None else likeliest(r) for r in reports],
            "text_offset": list(itertools.accumulate(map(len, tokens), initial=text_offset))[:-1]}


def envelope(kind: str, response_id: str, model: str, choices: list, usage_counts: dict | None = None) -> dict:
    """A whole response or one streamed chunk; kind is OpenAI's `object` field."""
    body = {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage_counts is not None:
        body["usage"] = usage_counts
    return body


__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "Message", "chat_choice", "chat_delta",
           "chat_logprobs", "chat_prompt", "completion_choice", "completion_logprobs", "completion_prompts", "envelope",
           "finish_reason", "max_new_tokens", "new_id", "refuse_unsupported", "sampling_config", "usage"]
