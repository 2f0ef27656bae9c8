"""Beam search through the server, as vLLM's OpenAI server offers it: each step, every running beam asks the engine.

`use_beam_search: true` (an extra, with `length_penalty` and `early_stopping`, beside `n`, the beam width and the
number of answers) needs no beam-search engine. At each step every running beam is one engine request for a
single token, asking the logprobs of the likeliest 2·n next tokens; those are all beam search needs, since the
best 2·n candidates over every beam are among each beam's own best 2·n. Lesson 10's ranking
(`minillm.strategies.beam.advance`) then keeps the beams and the finished hypotheses, so the answers are
transformers' `num_beams=n, num_return_sequences=n`.

The requests run beside everyone else's and hold their blocks once finished (`hold=True`): the next step's
beams are forks of the ones they extend (`Engine.continue_request`), each feeding only its new token over
blocks it shares with its siblings, copied only where it writes (lesson 10's copy-on-write), and the
previous step's requests are released. The prompt is computed once, the history never again. (vLLM's server
re-submits each beam's whole text and leans on its prefix cache, which recomputes a partial block per beam.)
"""

from __future__ import annotations

import asyncio

import torch

from ..decoding.outputs import GenerationStats
from ..decoding.sampling import SamplingConfig
from ..decoding.stopping import eos_ids
from ..strategies.beam import (BeamSearchError, BeamSearchOutput, BeamSettings, PromptSearch, advance, beam_output,
                               check_beam_options)
from .async_engine import AsyncEngine, EngineFailed, Submitted
from .openai_api import APIError, SamplingParameters

ONE_TOKEN = SamplingConfig(max_new_tokens=1, eos_token_id=())  # a beam's step: greedy, its logprobs asked


def beam_settings(body: SamplingParameters, max_new: int, tokenizer) -> BeamSettings:
    """The search a request asks for, or a 400 naming what beam search cannot honour (before any model work)."""
    refused = {"stream": body.stream, "logit_bias": bool(body.logit_bias),
               "logprobs": bool(getattr(body, "logprobs", None)), "echo": getattr(body, "echo", False),
               "response_format": getattr(body, "response_format", None) is not None,
               "tools": bool(getattr(body, "tools", None))}
    for name, used in refused.items():
        if used:
            raise APIError(400, f"use_beam_search does not support {name}: remove it, or drop use_beam_search",
                           param=name)
    if body.temperature not in (None, 0):
        raise APIError(400, f"use_beam_search ranks the model's own probabilities: temperature={body.temperature} "
                            f"cannot apply (leave it out or set 0)", param="temperature")
    config = SamplingConfig(max_new_tokens=max_new, stop=body.stop or (), repetition_penalty=body.repetition_penalty
                            or 1.0, presence_penalty=body.presence_penalty or 0.0,
                            frequency_penalty=body.frequency_penalty or 0.0)
    try:
        check_beam_options(config, body.n, body.length_penalty, body.early_stopping, body.n)
    except BeamSearchError as e:
        raise APIError(400, f"use_beam_search: {e}") from None
    eos = frozenset() if body.ignore_eos else frozenset(eos_ids(None, tokenizer))
    return BeamSettings(body.n, max_new, body.length_penalty, body.early_stopping, eos)


async def beam_search(engine: AsyncEngine, prompt: list[int], settings: BeamSettings, vocab_size: int, tokenizer,
                      deadline: float) -> BeamSearchOutput:
    """One prompt's search through the engine; its n best hypotheses, best first. Past `deadline` (the loop's
    time), the running beams end where they are, as max_tokens would end them."""
    loop = asyncio.get_running_loop()
    search = PromptSearch.start(prompt, settings.num_beams)
    held: list[int] = []  # the requests of the step before: beam i's is held[i] (at first, the prompt's for all)
    sources, tokens = [], []  # after a step: the beam each next beam extends, and its token
    try:
        for n_new in range(1, settings.max_new_tokens + 1):
            if loop.time() > deadline:
                search.stop_here(settings.length_penalty)
                break
            if n_new == 1:  # every beam is the prompt alone: one request
                submitted = await engine.submit([prompt], [ONE_TOKEN], top_logprobs=settings.candidates, hold=True)
            else:  # beam i forks the request its source beam came from, and feeds its newest token
                submitted = await engine.continue_from([held[source] for source in sources], tokens, ONE_TOKEN,
                                                       top_logprobs=settings.candidates, hold=True)
            engine.abort(held)  # released: the forks share what they need
            held = submitted.ids
            reports = await next_token_logprobs(engine, submitted)
            log_probs = torch.full((1, settings.num_beams, vocab_size), float("-inf"))
            for row, top in enumerate(reports):
                candidates, values = zip(*top)
                log_probs[0, row, list(candidates)] = torch.tensor(values)
            sources, tokens = advance([search], log_probs, n_new, settings)  # at first every source is beam 0
            if search.done:
                break
    finally:
        engine.abort(held)
    return beam_output([search], settings.num_beams, settings, tokenizer, GenerationStats())


async def next_token_logprobs(engine: AsyncEngine, submitted: Submitted) -> list[list[tuple[int, float]]]:
    """Each submitted one-token request's likeliest next tokens and their logprobs, once all have finished."""
    reports, left = {}, set(submitted.ids)
    while left:
        item = await submitted.events.get()
        if isinstance(item, EngineFailed):
            raise item
        if item.logprobs:
            reports[item.row] = item.logprobs[-1].top
        if item.finish_reason is not None:
            left.discard(item.row)
    return [reports[request_id] for request_id in submitted.ids]


__all__ = ["beam_search", "beam_settings", "next_token_logprobs"]
