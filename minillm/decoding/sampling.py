"""Choosing the next token: the sampling configuration and the logits processors.

Each processor is a small pure function from logits [batch, vocab] to logits of the
same shape; `process_logits` composes them in transformers' order:

    penalties on the raw logits (repetition; presence/frequency)   -- greedy too
    the structured-output mask (json_schema, regex; lesson 18)       -- greedy too
    then, only when sampling: temperature -> top-k -> top-p -> min-p

The mask comes before the warpers so that top-k, top-p and min-p choose among the tokens the
constraint allows (filtering first could leave none of them).

Removed tokens get -inf, so softmax gives them probability exactly 0. Everything is
computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

import torch

from .settings import GenerationConfig, SamplingError, check, is_int, is_real
from .structured import apply_token_mask


@dataclass(frozen=True)
class SamplingConfig(GenerationConfig):
    """A request's settings: when to stop (inherited) and how to pick tokens.

    Unlike transformers, nothing is implied: `do_sample=True` with `top_k=0` is plain
    multinomial sampling (transformers would silently apply top_k=50).
    `temperature=0` means greedy decoding.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1.0 disables
    min_p: float = 0.0  # 0.0 disables
    repetition_penalty: float = 1.0  # 1.0 disables; > 1 discourages any token already in the sequence
    presence_penalty: float = 0.0  # OpenAI semantics: subtracted once from every generated token's logit
    frequency_penalty: float = 0.0  # OpenAI semantics: subtracted per occurrence among generated tokens
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, -100..100) added to the logits first
    json_schema: str | None = None  # structured output: a JSON schema (JSON text; a dict is accepted) to match
    regex: str | None = None  # structured output: a regular expression the whole output must match
    or_text: bool = False  # with json_schema: text that does not begin with "{" is allowed too (tool_choice auto)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.logit_bias, dict):  # {token id: bias}, keys as ints or as JSON's strings
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        check(isinstance(self.logit_bias, tuple) and all(
            isinstance(pair, tuple) and len(pair) == 2 and is_int(pair[0]) and pair[0] >= 0 and is_real(pair[1])
            and -100 <= pair[1] <= 100 for pair in self.logit_bias), "logit_bias", self.logit_bias,
            "a map from token ids (integers >= 0) to biases in [-100, 100]")
        if isinstance(self.json_schema, (dict, bool)):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        check(self.json_schema is None or is_json_schema(self.json_schema), "json_schema", self.json_schema,
              "None or a JSON schema (a JSON object, as a dict or JSON text)")
        check(self.regex is None or (isinstance(self.regex, str) and self.regex != ""), "regex", self.regex,
              "None or a non-empty regular expression")
        check(self.json_schema is None or self.regex is None, "regex", self.regex,
              "None when json_schema is set (one constraint per request)")
        check(not self.or_text or self.json_schema is not None, "or_text", self.or_text,
              "False unless json_schema is set (it widens a schema to 'the schema or text')")
        check(isinstance(self.do_sample, bool), "do_sample", self.do_sample, "True or False")
        check(is_real(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
              "a finite number >= 0 (0 means greedy)")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 disables top-k)")
        check(is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1] (1 disables top-p)")
        check(is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1] (0 disables min-p)")
        check(is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              self.repetition_penalty, "a finite number > 0 (1 disables it, > 1 discourages repeats)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(is_real(value) and -2 <= value <= 2, name, value, "in [-2, 2] as in OpenAI's API (0 disables it)")
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), "seed", self.seed,
              "None or an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: sampling is off, or temperature 0 asks for the limit T -> 0 (the argmax)."""
        return not self.do_sample or self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """("json_schema", schema text) or ("regex", pattern): what the output must match (None: anything)."""
        if self.json_schema is not None:
            return ("json_schema_or_text" if self.or_text else "json_schema", self.json_schema)
        return ("regex", self.regex) if self.regex is not None else None

    def processing_key(self) -> tuple:
        """The fields the processors read: rows with equal keys are processed as one batch."""
        return tuple(getattr(self, name) for name in PROCESSING_FIELDS)


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingConfig))
def is_json_schema(text) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), (dict, bool))
    except ValueError:
        return False


PROCESSING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "logit_bias")


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


def check_logit_bias(config: SamplingConfig, vocab_size: int) -> None:
    """Every token a config's logit_bias names lies in the vocabulary (SamplingError naming the first that does
    not): checked where the vocabulary is known, before any forward."""
    outside = [token for token, _ in config.logit_bias if token >= vocab_size]
    check(not outside, "logit_bias", dict(config.logit_bias), f"token ids below {vocab_size} (the vocabulary's size); "
          f"{outside[0] if outside else ''} is not")


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's logit_bias: each listed token's logit plus its bias (-100 all but bans a token, +100 all but forces
    it), before every other processor, as llama.cpp's sampler chain and OpenAI apply it."""
    if not bias:
        return logits
    ids, values = zip(*bias)  # each below the vocabulary's size: `check_logit_bias`, when a sequence is created
    out = logits.clone()
    out[..., list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return out


def apply_presence_frequency_penalty(logits, generated_counts, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI/vLLM: logits -= frequency * count + presence * (count > 0), over generated tokens."""
    if presence == 0 and frequency == 0:
        return logits
    counts = generated_counts.to(logits.dtype)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T. A tiny T overflows float32 to inf (and softmax to NaN), or underflows
    to 0 itself; then the row's best logit is subtracted first (which changes no
    probability) and the division is done in float64: the best tokens get 0, the rest -inf.
    """
    if temperature == 1.0:
        return logits
    scaled = logits / temperature
    if temperature < 1.0 and not bool(scaled[logits.isfinite()].isfinite().all()):
        scaled = ((logits - logits.amax(dim=-1, keepdim=True)).double() / temperature).to(logits.dtype)
    return scaled


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


def process_logits(logits: torch.Tensor, config: SamplingConfig, history: TokenHistory | None,
                   allowed: torch.Tensor | None = None) -> torch.Tensor:
    """All processors in transformers' order. logits [B, V] -> float32 [B, V].

    allowed: bool [B, V], the tokens a structured-output constraint allows each row (None: all).
    """
    logits = apply_logit_bias(logits.float(), config.logit_bias)
    if history is not None:
        logits = apply_repetition_penalty(logits, history.seen, config.repetition_penalty)
        logits = apply_presence_frequency_penalty(
            logits, history.generated_counts, config.presence_penalty, config.frequency_penalty
        )
    logits = apply_token_mask(logits, allowed)
    if config.greedy:
        return logits
    logits = apply_temperature(logits, config.temperature)
    logits = apply_top_k(logits, config.top_k)
    logits = apply_top_p(logits, config.top_p)
    return apply_min_p(logits, config.min_p)


# ------------------------------------------------------------------ choosing


def row_generators(config: SamplingConfig, n_rows: int, device=None) -> list[torch.Generator] | None:
    """One generator per row, each seeded with `config.seed` (None when decoding greedily)."""
    if config.greedy:
        return None
    return generators_for([config] * n_rows, device)


def generators_for(configs: list[SamplingConfig], device=None) -> list[torch.Generator | None]:
    """One random stream per row, seeded by that row's own seed (None for greedy rows).

    A row's random stream therefore depends only on its own settings, never on its
    neighbours or its index: the same prompt and seed give the same text alone or in
    any batch. (Identical prompts with one seed in one batch give identical samples.)
    """
    generators = []
    for config in configs:
        if config.greedy:
            generators.append(None)
            continue
        seed = config.seed if config.seed is not None else int(torch.randint(0, 2**62, ()).item())
        generators.append(torch.Generator(device=device or "cpu").manual_seed(seed))
    return generators


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform number per row from that row's own generator.

    probs [B, V] -> tokens [B]. A token of probability 0 is never chosen.
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    u = torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(probs.device)
    targets = (u * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    # The guard for a target on the last cumulative value: torch.rand's float32 u is at most 1 - 2**-24, and
    # u * total rounds below any normal total, but a u with more bits (or a subnormal total) can reach it; then
    # the search would pass the last token with mass (lesson 03's exercise 3 builds that case).
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(tokens, last_nonzero)


def choose_next(processed_logits: torch.Tensor, config: SamplingConfig, generators) -> torch.Tensor:
    """Processed logits [B, V] -> next tokens [B]: argmax (first index on ties) or a draw.

    A row of NaN logits (a numerical failure upstream) is refused, never turned into a token.
    """
    if bool(processed_logits.isnan().any()):
        raise FloatingPointError("the model produced NaN logits; try float32 (--dtype float32) or check the weights")
    if config.greedy:
        return processed_logits.argmax(dim=-1)
    return sample_from_probs(processed_logits.softmax(dim=-1), generators)


# ------------------------------------------------------------------ rows with their own settings


def groups_of_equal_settings(configs: list[SamplingConfig]) -> list[list[int]]:
    """Row indices grouped by identical processing settings, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for row, config in enumerate(configs):
        groups.setdefault(config.processing_key(), []).append(row)
    return list(groups.values())


def process_rows(logits: torch.Tensor, configs: list[SamplingConfig], history: TokenHistory | None,
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
    """`process_logits` where row b follows configs[b]: logits [B, V] -> float32 [B, V].

    Rows that share settings are processed together; every processor works row by row,
    so a row's result is the one it gets alone. allowed: bool [B, V] or None, as for process_logits.
    """
    groups = groups_of_equal_settings(configs)
    if len(groups) == 1:
        return process_logits(logits, configs[0], history, allowed)
    processed = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups:
        index = torch.tensor(rows, device=logits.device)
        processed[index] = process_logits(logits[index], configs[rows[0]],
                                          history.select(index) if history is not None else None,
                                          allowed[index.to(allowed.device)] if allowed is not None else None)
    return processed


def choose_rows(processed_logits: torch.Tensor, configs: list[SamplingConfig], generators) -> torch.Tensor:
    """`choose_next` where row b follows configs[b] and draws from generators[b]: [B, V] -> [B]."""
    groups = groups_of_equal_settings(configs)
    if len(groups) == 1:
        return choose_next(processed_logits, configs[0], generators)
    tokens = torch.empty(len(configs), dtype=torch.long, device=processed_logits.device)
    for rows in groups:
        index = torch.tensor(rows, device=processed_logits.device)
        tokens[index] = choose_next(processed_logits[index], configs[rows[0]], [generators[r] for r in rows])
    return tokens


def row_configs(config, n_rows: int, overrides: dict) -> list[SamplingConfig]:
    """One validated SamplingConfig per row: a single config (or None) is shared by every row."""
    configs = list(config) if isinstance(config, (list, tuple)) else [config] * n_rows
    if len(configs) != n_rows:
        raise ValueError(f"{len(configs)} configs for {n_rows} prompts: pass one config, or one per prompt")
    return [(c or SamplingConfig()).with_(**overrides) if overrides else (c or SamplingConfig()) for c in configs]


__all__ = ["row_configs",
    "SamplingConfig", "SamplingError", "TokenHistory", "process_logits", "choose_next", "row_generators",
    "sample_from_probs", "generators_for", "process_rows", "choose_rows", "groups_of_equal_settings",
    "apply_logit_bias", "check_logit_bias", "apply_repetition_penalty", "apply_presence_frequency_penalty",
    "apply_temperature",
    "apply_top_k", "apply_top_p", "apply_min_p", "SAMPLING_FIELDS",
]
