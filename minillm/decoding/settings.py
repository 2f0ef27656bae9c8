"""Generation-level settings and the validation every settings object shares.

Two kinds of settings steer a generation, and different code reads each:

* generation-level (`GenerationConfig`): when a row stops: `max_new_tokens`, `eos_token_id`,
  `stop` strings. Read by `minillm.decoding.stopping`.
* sampling-level (`minillm.decoding.sampling.SamplingConfig` adds them): how the next token is
  chosen: `do_sample`, `temperature`, `top_k`, `top_p`, `min_p`, the penalties, `seed`.
  Read by the logits processors and the sampler.

`SamplingConfig` extends `GenerationConfig`, so one object carries a request's whole
settings, and each row of a batch may carry its own (a server batches requests with
different settings). Field names follow transformers' `GenerationConfig`. Every field is
checked when the object is made, and a bad value is one line naming the field, the
value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace


class SamplingError(ValueError):
    """An impossible setting; the message names the field, value and allowed range.

    `field` holds the offending field's name, so a front end (the CLI) can name its own flag.
    """

    def __init__(self, field: str, value, allowed: str):
        super().__init__(f"{field}={value!r} is invalid: must be {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise SamplingError(name, value, allowed)


@dataclass(frozen=True)
class GenerationConfig:
    """When a row stops."""

    max_new_tokens: int = 128
    eos_token_id: int | tuple[int, ...] | None = None  # None: the tokenizer's; (): ignore EOS
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens,
              "an integer >= 0")
        eos = self.eos_token_id
        check(eos is None or (is_int(eos) and eos >= 0)
              or (isinstance(eos, tuple) and all(is_int(i) and i >= 0 for i in eos)),
              "eos_token_id", eos, "None (the tokenizer's), a token id >= 0, or a list of them (empty: never stop on EOS)")
        check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
              "a string or a list of non-empty strings")

    def with_(self, **changes):
        """A copy with some fields changed, validated again."""
        return replace(self, **changes)


__all__ = ["GenerationConfig", "SamplingError", "check", "is_int", "is_real"]
