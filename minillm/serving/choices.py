"""One HTTP request's choices: the engine's events gathered as OpenAI's choice indices, with echo and usage.

A request with `n` choices over several prompts becomes one engine request per (prompt, choice);
`Choices` maps each engine event back to its choice, prepends the echoed prompt, and adds up
what the non-streaming answer returns whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..decoding.logprobs import TokenLogprobs
from ..decoding.outputs import GenerationEvent
from .async_engine import Submitted
from .openai_api import usage


@dataclass
class Piece:
    """What a choice shows: one event's share of it, or, added up, the whole choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # One per token where logprobs are asked; None for an echoed prompt's first token, which nothing predicts.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None

    def extend(self, piece: "Piece") -> None:
        self.text += piece.text
        self.token_ids += piece.token_ids
        self.logprobs += piece.logprobs
        self.finish_reason = piece.finish_reason


class Choices:
    """One HTTP request's engine requests (n choices per prompt), as OpenAI's choice indices.

    prompt_tokens counts each prompt once, however many choices share it, as OpenAI's usage does.
    echo: each choice's prompt text, which its first piece begins with (tokens and logprobs too).
    scoring_only (echo and logprobs with max_tokens 0): the engine draws one token to run the
    prompt's forward, and the choices leave it out, as vLLM does.
    """

    def __init__(self, submitted: Submitted, prompts: list[list[int]], prompt_tokens: int, with_logprobs: bool,
                 echo: list[str] | None, scoring_only: bool):
        self.submitted, self.prompts, self.prompt_tokens = submitted, prompts, prompt_tokens
        self.with_logprobs, self.echo, self.scoring_only = with_logprobs, echo, scoring_only
        self.index = {request_id: i for i, request_id in enumerate(submitted.ids)}
        self.whole = [Piece() for _ in submitted.ids]
        self.started = [False] * len(submitted.ids)
        self.completion_tokens = 0

    def record(self, event: GenerationEvent) -> tuple[int, Piece]:
        """The choice an event belongs to, and what it adds to it."""
        i = self.index[event.row]
        if self.scoring_only:
            piece = Piece(finish_reason="length" if event.finish_reason else None)
        else:
            piece = Piece(event.text, event.token_ids, event.logprobs or [], event.finish_reason)
            self.completion_tokens += len(event.token_ids)
        if self.echo is not None and not self.started[i]:
            prompt = self.prompts[i]
            scored = event.prompt_logprobs or [None] * (len(prompt) - 1)  # None: it timed out before its prompt ran
            piece = Piece(self.echo[i] + piece.text, prompt + piece.token_ids,
                          ([None, *scored] if self.with_logprobs else []) + piece.logprobs, piece.finish_reason)
        self.started[i] = True
        self.whole[i].extend(piece)
        return i, piece

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)
