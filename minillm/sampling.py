"""Choosing the next token: the sampling configuration and the logits processors.

Each processor is a small pure function from logits [batch, vocab] to logits of the
same shape; `process_logits` composes them in transformers' order:

    penalties on the raw logits (repetition; presence/frequency)   -- greedy too
    then, only when sampling: temperature -> top-k -> top-p -> min-p

Removed tokens get -inf, so softmax gives them probability exactly 0. Everything is
computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

import torch


class SamplingError(ValueError):
    """An impossible sampling setting; the message names the field, value and allowed range.

    `field` holds the offending field's name, so a front end (the CLI) can name its own flag.
    """

    def __init__(self, field: str, value, allowed: str):
        super().__init__(f"{field}={value!r} is invalid: must be {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. Field names follow transformers' GenerationConfig.

    Unlike transformers, nothing is implied: `do_sample=True` with `top_k=0` is plain
    multinomial sampling (transformers would silently apply top_k=50).
    `temperature=0` means greedy decoding.
    """

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    min_p: float = 0.0  # 0.0 disables
    repetition_penalty: float = 1.0  # 1.0 disables; > 1 discourages any token already in the sequence
    presence_penalty: float = 0.0  # OpenAI semantics: subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # OpenAI semantics: subtracted per occurrence among generated tokens
    eos_token_id: int | tuple[int, ...] | None = None  # None: the tokenizer's; (): ignore EOS
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", self.max_new_tokens,
               "an integer >= 0")
        _check(isinstance(self.do_sample, bool), "do_sample", self.do_sample, "True or False")
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "a finite number >= 0 (0 means greedy)")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 disables top-k)")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1] (1 disables top-p)")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1] (0 disables min-p)")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "a finite number > 0 (1 disables it, > 1 discourages repeats)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, value, "in [-2, 2] as in OpenAI's API (0 disables it)")
        eos = self.eos_token_id
        _check(eos is None or (_is_int(eos) and eos >= 0)
               or (isinstance(eos, tuple) and all(_is_int(i) and i >= 0 for i in eos)),
               "eos_token_id", eos, "None (the tokenizer's), a token id >= 0, or a list of them (empty: never stop on EOS)")
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a string or a list of non-empty strings")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed", self.seed,
               "None or an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: sampling is off, or temperature 0 asks for the limit T -> 0 (the argmax)."""
        return not self.do_sample or self.temperature == 0

    def with_(self, **changes) -> "SamplingConfig":
        """A copy with some fields changed, validated again."""
        return replace(self, **changes)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise SamplingError(name, value, allowed)


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingConfig))


# ------------------------------------------------------------------ token history


@dataclass
class TokenHistory:
    """What each row has seen, as dense [batch, vocab] tables the penalties can use directly.

    `seen` marks every token in the sequence, prompt included (repetition penalty);
    `generated_counts` counts generated tokens only (presence/frequency penalties).
    """

    seen: torch.Tensor  # bool [B, V]
    generated_counts: torch.Tensor  # int32 [B, V]

    @classmethod
    def from_prompts(cls, prompts: list[list[int]], vocab_size: int, device=None) -> "TokenHistory":
        seen = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
        for row, ids in enumerate(prompts):
            if ids:
                seen[row, torch.tensor(ids, device=device)] = True
        return cls(seen, torch.zeros(len(prompts), vocab_size, dtype=torch.int32, device=device))

    def add(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Record one new token per row (tokens [B]); `rows` limits it to some rows."""
        rows = torch.arange(len(tokens), device=tokens.device) if rows is None else rows
        self.seen[rows, tokens] = True
        self.generated_counts[rows, tokens] += 1

    def select(self, rows: torch.Tensor) -> "TokenHistory":
        return TokenHistory(self.seen[rows], self.generated_counts[rows])


# ------------------------------------------------------------------ processors (pure functions)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' rule (Keskar et al. 2019): for every token already in the sequence,
    divide a positive logit by `penalty` and multiply a negative one; each token once."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalty(logits, generated_counts, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI/vLLM: logits -= frequency * count + presence * (count > 0), over generated tokens."""
    if presence == 0 and frequency == 0:
        return logits
    counts = generated_counts.to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep tokens scoring at least the k-th best (ties at the boundary survive)."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth_best = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_best, -math.inf)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the most probable tokens whose mass reaches p (always the best one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= 1 - p  # the low tail whose total mass stays within 1 - p
    remove_sorted[..., -1] = False  # the most probable token always survives
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens with probability >= min_p * (the best token's probability)."""
    if min_p == 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)  # never empty the row
    return logits.masked_fill(remove, -math.inf)


def process_logits(logits: torch.Tensor, config: SamplingConfig, history: TokenHistory | None) -> torch.Tensor:
    """All processors in transformers' order. logits [B, V] -> float32 [B, V]."""
    logits = logits.float()
    if history is not None:
        logits = apply_repetition_penalty(logits, history.seen, config.repetition_penalty)
        logits = apply_presence_frequency_penalty(
            logits, history.generated_counts, config.presence_penalty, config.frequency_penalty
        )
    if config.greedy:
        return logits
    logits = apply_temperature(logits, config.temperature)
    logits = apply_top_k(logits, config.top_k)
    logits = apply_top_p(logits, config.top_p)
    return apply_min_p(logits, config.min_p)


# ------------------------------------------------------------------ choosing


def row_generators(config: SamplingConfig, n_rows: int, device=None) -> list[torch.Generator] | None:
    """One generator per row, each seeded with `config.seed`.

    A row's random stream therefore depends only on the seed, never on its
    neighbours or its index: the same prompt and seed give the same text alone or
    in any batch. (Identical prompts in one batch give identical samples.)
    """
    if config.greedy:
        return None
    seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
    return [torch.Generator(device=device or "cpu").manual_seed(seed) for _ in range(n_rows)]


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform number per row from that row's own generator.

    probs [B, V] -> tokens [B]. A token of probability 0 is never chosen.
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(probs.device)
    targets = (u * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    # Rounding can push a target onto the last cumulative value: fall back to the last token with mass.
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(tokens, last_nonzero)


def choose_next(processed_logits: torch.Tensor, config: SamplingConfig, generators) -> torch.Tensor:
    """Processed logits [B, V] -> next tokens [B]: argmax (first index on ties) or a draw."""
    if config.greedy:
        return processed_logits.argmax(dim=-1)
    return sample_from_probs(processed_logits.softmax(dim=-1), generators)


__all__ = [
    "SamplingConfig", "SamplingError", "TokenHistory", "process_logits", "choose_next", "row_generators",
    "sample_from_probs", "apply_repetition_penalty", "apply_presence_frequency_penalty", "apply_temperature",
    "apply_top_k", "apply_top_p", "apply_min_p", "SAMPLING_FIELDS",
]
