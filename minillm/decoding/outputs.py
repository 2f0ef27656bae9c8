"""What every decoding strategy takes and gives back: prompts in; events and outputs out.

Strategies (`minillm.strategies.generate.generate`, speculative decoding, beam search, and later the
serving engine) accept prompts in the same forms and report in the same shapes:

    GenerationEvent   one row's progress in one step: new token ids, newly final text,
                      and the finish reason on the row's last event (with their logprobs,
                      `minillm.decoding.logprobs`, where the row asks for them)
    RowOutput         one row's whole result
    GenerationOutput  every row's result and the run's statistics
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .logprobs import TokenLogprobs
from .settings import is_int
from .stopping import RowState


@dataclass
class GenerationEvent:
    row: int  # index of the prompt in the call
    token_ids: list[int]  # tokens added to the row in this step (several after a speculative round)
    text: str  # text that became final in this step (what a streamer prints)
    finish_reason: str | None = None  # "eos", "stop" or "length" on the row's last event
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, where the row asks for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens after the first: on the first event, if asked


@dataclass
class RowOutput:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, including the EOS or stop-completing token
    text: str  # generated text without EOS and without the stop string
    finish_reason: str  # "eos", "stop" or "length" ("abort": a request the engine was told to abort)

    @classmethod
    def from_state(cls, state: RowState) -> "RowOutput":
        return cls(state.prompt_ids, state.token_ids, state.text, state.finish_reason)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # real (unpadded) prompt tokens over all rows
    prefill_seconds: float = 0.0  # from the call to the first token of every row (time to first token)
    decode_tokens: int = 0  # tokens produced after each row's first one
    decode_seconds: float = 0.0
    forward_passes: int = 0  # model calls, prefills included
    build_seconds: float = 0.0  # loading or building compiled graphs, before the run (not in the times above)
    extra: dict = field(default_factory=dict)  # what later lessons add (speculative: drafted, accepted, ...)

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float | None:
        """None when nothing was decoded after the first token (no rate to report)."""
        return self.decode_tokens / self.decode_seconds if self.decode_tokens and self.decode_seconds > 0 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(extra=dict(self.extra), time_to_first_token=self.time_to_first_token,
                 decode_tokens_per_second=self.decode_tokens_per_second)
        return d

    def add(self, other: "GenerationStats") -> None:
        """Sum another run's counters and times into this one (runs in sequence)."""
        for name in ("prompt_tokens", "prefill_seconds", "decode_tokens", "decode_seconds", "forward_passes",
                     "build_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, value in other.extra.items():  # counters (drafted, accepted, ...) add up
            self.extra[key] = self.extra.get(key, 0) + value if isinstance(value, (int, float)) else value


@dataclass
class GenerationOutput:
    rows: list[RowOutput]
    stats: GenerationStats

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.rows]

    @property
    def token_ids(self) -> list[list[int]]:
        return [r.token_ids for r in self.rows]


def encode_prompts(prompts, tokenizer) -> list[list[int]]:
    """A string, a list or 1-D tensor/array of ids, or a list of either -> one id list per row."""
    if hasattr(prompts, "tolist") and not isinstance(prompts, (list, tuple, str)):  # a tensor or NumPy array
        if getattr(prompts, "dtype", None) is not None and not _integer_dtype(prompts.dtype):
            raise ValueError(f"token ids must be integers, got a {prompts.dtype} array: pass a long tensor or "
                             f"list of ints")
        if prompts.ndim not in (1, 2):
            raise ValueError(f"token ids must be 1-D (one prompt) or 2-D (a batch), got {prompts.ndim}-D")
        prompts = prompts.tolist()
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; got a "
                         f"{type(prompts).__name__}")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass tokenizer=... or token ids")
            p = tokenizer.encode(p)
        elif hasattr(p, "tolist"):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or not all(is_int(t) for t in p):
            raise ValueError(f"prompt {i} is not text or a list of integer token ids: got {type(p).__name__}")
        rows.append([int(t) for t in p])
    if not rows:
        raise ValueError("no prompts given: pass at least one prompt")
    return rows


def _integer_dtype(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return getattr(dtype, "kind", "") in "iu"


def check_prompts(rows: list[list[int]], context_length: int, vocab_size: int) -> None:
    for i, ids in enumerate(rows):
        if not ids:
            raise ValueError(f"prompt {i} is empty: give it at least one token")
        if len(ids) > context_length:
            raise ValueError(f"prompt {i} has {len(ids)} tokens but the model's context is {context_length}: shorten it")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} holds a token id outside the vocabulary [0, {vocab_size})")


def check_fits_context(prompt_tokens: int, max_new_tokens: int, context: int, *, prompt: str = "the prompt",
                       budget: str = "max_new_tokens", also: str = "") -> None:
    """Refuse a prompt plus a token budget that outgrows the context, before any model work.

    Without a sliding window, tokens past the context cannot be computed: the request
    could only fail late or run on, sliding, for as long as it is allowed. The command
    line and the server refuse it with this one check, each naming its own knobs:
    `prompt` (which prompt), `budget` (the flag or field that set max_new_tokens) and
    `also` (one more way out, such as the CLI's --slide). The message opens as OpenAI's
    does ("this model's maximum context length is ..."), which clients look for.
    """
    if prompt_tokens + max_new_tokens <= context:
        return
    room = context - prompt_tokens
    fix = f"lower {budget} to at most {room} or shorten {prompt}" if room > 0 else f"shorten {prompt}"
    raise ValueError(f"this model's maximum context length is {context} tokens, but {prompt} has {prompt_tokens} "
                     f"tokens and {budget} asks for {max_new_tokens} more: {fix}{also}")


def drain(events, streamer=None):
    """Run a generation to its end, handing each event's text to `streamer`; returns its output."""
    for event in events:
        if streamer is not None and event.text:
            streamer.put(event.row, event.text)
    if streamer is not None:
        streamer.end()
    return events.output


__all__ = ["GenerationEvent", "RowOutput", "GenerationStats", "GenerationOutput", "encode_prompts", "check_prompts",
           "check_fits_context", "drain"]
