"""Beam search: keep the `num_beams` most probable partial continuations, not just one.

Greedy decoding commits to the best next token, yet the most probable *sequence* may
start with a worse token. Beam search keeps `num_beams` running hypotheses per prompt.
Each step scores every one-token extension of every hypothesis by its summed
log-probability,

    score(y_1..y_t) = sum_i log p(y_i | prompt, y_<i)          (num_beams * vocab candidates)

and keeps the best. A candidate ending in EOS (or reaching `max_new_tokens`) is set
aside as finished with the length-normalised score

    sequences_score = score / n ** length_penalty              n = new tokens, EOS included

so `length_penalty` > 0 favours longer answers, < 0 shorter ones. Each prompt keeps
the `num_beams` best finished hypotheses; the best `num_return_sequences` are returned.

The rules follow transformers' `generate(num_beams=..., do_sample=False)` exactly:

* Each step looks at the top 2 * num_beams candidates (more with several EOS ids, so
  that num_beams unfinished ones remain). Only candidates ranked within the top
  num_beams may finish; the best num_beams unfinished ones run on.
* A prompt is done once it holds num_beams finished hypotheses and
  - `early_stopping=True`: at once;
  - `early_stopping=False`: when the best running hypothesis, scored at its current
    length, could not beat the worst finished one (a heuristic: with length_penalty > 0
    a longer continuation might still have won);
  - `early_stopping="never"`: the same test, but with length_penalty > 0 the running
    hypothesis is scored at the longest length it could reach (the exact bound).
* Generation stops when every prompt is done or `max_new_tokens` is reached.

The cache follows the beams through the runner's `select`: the prompt is
prefilled once per prompt and copied to its beams, and each step gathers every
surviving beam's rows (a beam chosen twice is duplicated, an abandoned one dropped),
as do finished prompts. A contiguous cache copies those rows, history and all;
cache="blocks" keeps each beam in a paged pool, where the same reorder shares blocks and
copies only a shared partial block a beam writes into (`minillm.cache.block_rows`).
`stats.extra["cache_copied_bytes"]` says what the reorders copied, and with cache="blocks"
`stats.extra["cache_peak_bytes"]` the most the pool's blocks held at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..cache.block_rows import BlockCache
from ..decoding.outputs import GenerationOutput, GenerationStats, RowOutput, check_prompts, encode_prompts
from ..decoding.sampling import SamplingConfig
from ..decoding.stopping import RowState, eos_ids
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from .generate import generate

EARLY_STOPPING = (True, False, "never")
EXCLUDED = -1.0e9  # transformers' score for "not a candidate" (finished beams may not run on)


class BeamSearchError(ValueError):
    """A setting beam search cannot honour; the message names it and the fix."""


@dataclass
class BeamSearchOutput(GenerationOutput):
    """`rows[i * num_return_sequences + j]` is prompt i's j-th best hypothesis (best first)."""

    sequences_scores: list[float] = field(default_factory=list)  # transformers' sequences_scores, one per row


def check_beam_options(config: SamplingConfig, num_beams, length_penalty, early_stopping,
                       num_return_sequences) -> None:
    """Refuse, in one line, what beam search cannot do (before any model work)."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise BeamSearchError(f"num_beams={num_beams!r} is invalid: must be an integer >= 1 (1 is greedy decoding)")
    if isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int) \
            or not 1 <= num_return_sequences <= num_beams:
        raise BeamSearchError(f"num_return_sequences={num_return_sequences!r} is invalid: must be between 1 and "
                              f"num_beams={num_beams} (a search keeps only num_beams hypotheses)")
    if early_stopping not in EARLY_STOPPING or not isinstance(early_stopping, (bool, str)):
        raise BeamSearchError(f"early_stopping={early_stopping!r} is invalid: use True, False or 'never'")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not math.isfinite(length_penalty):
        raise BeamSearchError(f"length_penalty={length_penalty!r} is invalid: must be a finite number "
                              f"(> 0 favours longer answers, < 0 shorter ones)")
    if not config.greedy:
        raise BeamSearchError("beam search does not sample: set do_sample=False (or temperature 0); "
                              "beam sampling is not supported")
    unsupported = {"repetition_penalty": config.repetition_penalty != 1, "stop": bool(config.stop),
                   "presence_penalty": config.presence_penalty != 0, "frequency_penalty": config.frequency_penalty != 0,
                   "json_schema": config.json_schema is not None, "regex": config.regex is not None}
    for name, is_set in unsupported.items():
        if is_set:
            raise BeamSearchError(f"beam search does not support {name}={getattr(config, name)!r}: leave it at its "
                                  f"default or use greedy decoding / sampling")
    if config.max_new_tokens < 1:
        raise BeamSearchError(f"max_new_tokens={config.max_new_tokens} is invalid for beam search: must be >= 1")


@torch.inference_mode()
def continuation_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """log p(token_i | prompt, tokens before it) for each generated token, from one forward: [len(token_ids)]."""
    if not token_ids:
        return torch.zeros(0)
    ids = list(prompt_ids) + list(token_ids)
    if len(ids) > model.config.context_length:
        raise ValueError(f"prompt + continuation is {len(ids)} tokens but the model's context is "
                         f"{model.config.context_length}: score a shorter continuation")
    tokens = torch.tensor([ids], device=model.device)
    logits = model(tokens, torch.arange(len(ids), device=model.device)[None])[0, len(prompt_ids) - 1:-1]  # [N, V]
    log_probs = logits.float().log_softmax(dim=-1)
    return log_probs.gather(-1, torch.tensor(token_ids, device=model.device)[:, None])[:, 0].cpu()


@dataclass
class PromptSearch:
    """One prompt's search: its running beams and its best finished hypotheses (best first)."""

    prompt_ids: list[int]
    beams: list[list[int]]  # running hypotheses' new tokens, num_beams of them
    scores: torch.Tensor  # float32 [num_beams]: running hypotheses' summed log-probs
    finished: list[tuple[float, list[int]]] = field(default_factory=list)
    done: bool = False

    @classmethod
    def start(cls, prompt_ids: list[int], num_beams: int) -> "PromptSearch":
        """Before the first step: num_beams copies of the prompt, of which only the first may expand."""
        scores = torch.full((num_beams,), EXCLUDED)
        scores[0] = 0.0
        return cls(list(prompt_ids), [[] for _ in range(num_beams)], scores)

    def stop_here(self, length_penalty: float) -> None:
        """End the search now (a time limit): the running beams join the finished ones, scored at their length."""
        running = [(float(score) / len(beam) ** length_penalty, beam) for score, beam in zip(self.scores, self.beams)
                   if beam and score > EXCLUDED / 2]
        self.finished = sorted(self.finished + running, key=lambda f: -f[0])[:len(self.beams)]
        self.done = True


@dataclass(frozen=True)
class BeamSettings:
    """What every step of a search reads."""

    num_beams: int
    max_new_tokens: int
    length_penalty: float
    early_stopping: bool | str
    eos: frozenset[int]

    @property
    def candidates(self) -> int:
        """Candidates looked at per step: enough that num_beams unfinished ones remain whatever ends."""
        return max(2, 1 + len(self.eos)) * self.num_beams


def advance(searches: list[PromptSearch], log_probs: torch.Tensor, n_new: int,
            settings: BeamSettings) -> tuple[list[int], list[int]]:
    """One step of the searches still running (see the module docstring): log_probs float32 [A, num_beams, V], each
    beam's next-token log-probabilities (a vocabulary entry of -inf is never picked). Updates each search's beams,
    scores, finished hypotheses and `done`; returns, for the beams that run on, the row (a * num_beams + beam) each
    continues and the token it takes."""
    A, num_beams, vocab = log_probs.shape
    totals = log_probs + torch.stack([s.scores for s in searches])[:, :, None]  # [A, beams, V]
    top_scores, top_index = totals.view(A, -1).topk(settings.candidates, dim=-1)  # [A, K], best first
    source_beam, token = top_index // vocab, top_index % vocab
    at_length = n_new == settings.max_new_tokens
    hits = torch.isin(token, torch.tensor(sorted(settings.eos), dtype=torch.long)) | at_length  # [A, K]: ends
    finished_scores = top_scores / (n_new ** settings.length_penalty)
    running_scores = top_scores + hits.float() * EXCLUDED
    next_scores, next_rank = running_scores.topk(num_beams, dim=-1)  # [A, beams]
    sources, next_tokens = [], []
    for a, search in enumerate(searches):
        beam_of, token_of, ranks = source_beam[a].tolist(), token[a].tolist(), next_rank[a].tolist()
        for k in range(num_beams):  # only the top num_beams candidates may finish
            if hits[a, k]:
                search.finished.append((finished_scores[a, k].item(), search.beams[beam_of[k]] + [token_of[k]]))
        search.finished = sorted(search.finished, key=lambda f: -f[0])[:num_beams]  # stable: older first on ties
        search.beams = [search.beams[beam_of[r]] + [token_of[r]] for r in ranks]
        search.scores = next_scores[a]
        search.done = _is_done(search, n_new, settings)
        if not search.done:
            sources += [a * num_beams + beam_of[r] for r in ranks]
            next_tokens += [token_of[r] for r in ranks]
    return sources, next_tokens


@torch.inference_mode()
def beam_search(model, prompts, config: SamplingConfig | None = None, *, num_beams: int = 4,
                length_penalty: float = 1.0, early_stopping: bool | str = False, num_return_sequences: int = 1,
                tokenizer=None, cache: str = "static", **config_overrides) -> BeamSearchOutput:
    """Beam search for each prompt; returns num_return_sequences rows per prompt and their scores.

    config: max_new_tokens and eos_token_id are used; sampling, penalties and stop strings are
        refused (`check_beam_options`). Keyword arguments override its fields.
    num_beams=1 is greedy decoding (as in transformers; its score is still reported).
    cache: "static" (default), "dynamic", "blocks" (beams sharing blocks) or "none"; all give the same result.
    """
    config = (config or SamplingConfig()).with_(**config_overrides)
    check_beam_options(config, num_beams, length_penalty, early_stopping, num_return_sequences)
    prompt_ids = encode_prompts(prompts, tokenizer)
    check_prompts(prompt_ids, model.config.context_length, model.config.vocab_size)
    longest = max(map(len, prompt_ids))
    if longest + config.max_new_tokens > model.config.context_length:
        raise BeamSearchError(f"prompt ({longest} tokens) + max_new_tokens={config.max_new_tokens} exceeds the "
                              f"model's context of {model.config.context_length}: beam search does not slide the "
                              f"window; lower max_new_tokens")
    eos = eos_ids(config.eos_token_id, tokenizer)
    if num_beams == 1:
        return _greedy(model, prompt_ids, config, length_penalty, tokenizer, cache)

    stats = GenerationStats(prompt_tokens=sum(map(len, prompt_ids)))
    t_start = time.perf_counter()
    n_prompts, vocab = len(prompt_ids), model.config.vocab_size
    settings = BeamSettings(num_beams, config.max_new_tokens, length_penalty, early_stopping, frozenset(eos))
    runner = ModelRunner(model, cache=cache, max_len=longest + config.max_new_tokens, max_batch=n_prompts * num_beams)

    def hypotheses(token_lists):  # each beam is a sequence of its own: its prompt and its new tokens
        return [Sequence.create(ids, config, vocab_size=vocab) for ids in token_lists]

    logits = runner.prefill(hypotheses(prompt_ids))  # [P, V]: one forward per prompt, then copied to its beams
    stats.forward_passes += 1
    logits = logits.repeat_interleave(num_beams, dim=0)  # [P * num_beams, V]
    runner.select(torch.arange(n_prompts).repeat_interleave(num_beams),
                  hypotheses([ids for ids in prompt_ids for _ in range(num_beams)]))
    searches = [PromptSearch.start(ids, num_beams) for ids in prompt_ids]

    for n_new in range(1, config.max_new_tokens + 1):  # n_new: tokens each candidate holds after this step
        active = [s for s in searches if not s.done]  # the batch rows, num_beams per search, in this order
        log_probs = logits.float().log_softmax(dim=-1).cpu().view(len(active), num_beams, vocab)
        sources, next_tokens = advance(active, log_probs, n_new, settings)
        next_beams = [s.prompt_ids + beam for s in active if not s.done for beam in s.beams]
        if stats.forward_passes == 1:
            stats.prefill_seconds = time.perf_counter() - t_start
        if n_new == config.max_new_tokens or not sources:
            break
        beams = hypotheses(next_beams)
        runner.select(sources, beams)  # the cache rows follow their beams: duplicated, kept or dropped
        logits = runner.decode(beams)  # each beam's newest token
        stats.forward_passes += 1
        stats.decode_tokens += len(next_tokens)

    stats.decode_seconds = time.perf_counter() - t_start - stats.prefill_seconds
    cache_state = runner.session.cache  # None without a cache
    stats.extra.update(num_beams=num_beams,  # decode_tokens counts beam rows forwarded after the first step
                       cache_copied_bytes=cache_state.copied_bytes if cache_state is not None else 0)
    if isinstance(cache_state, BlockCache):
        stats.extra["cache_peak_bytes"] = cache_state.peak_bytes
    return beam_output(searches, num_return_sequences, settings, tokenizer, stats)


def _is_done(search: PromptSearch, n_new: int, settings: BeamSettings) -> bool:
    """Can this prompt's finished set still change? (transformers' early-stopping rules)"""
    if len(search.finished) < settings.num_beams:
        return False
    if settings.early_stopping is True:
        return True
    penalty = settings.length_penalty
    reachable = settings.max_new_tokens if (settings.early_stopping == "never" and penalty > 0) else n_new
    best_running = (search.scores[:1] / (reachable ** penalty)).item()
    return not best_running > search.finished[-1][0]


def beam_output(searches, num_return_sequences: int, settings: BeamSettings, tokenizer, stats) -> BeamSearchOutput:
    """Each search's num_return_sequences best finished hypotheses as rows (text, finish reason), best first."""
    rows, scores = [], []
    for search in searches:
        for score, token_ids in search.finished[:num_return_sequences]:
            state = RowState(search.prompt_ids, settings.max_new_tokens, settings.eos, (), tokenizer)
            for token in token_ids:
                state.push(token)
            rows.append(RowOutput(search.prompt_ids, token_ids, state.text, state.finish_reason))
            scores.append(score)
    return BeamSearchOutput(rows, stats, scores)


def _greedy(model, prompt_ids, config, length_penalty, tokenizer, cache) -> BeamSearchOutput:
    """num_beams=1: greedy decoding, scored like a single beam."""
    out = generate(model, prompt_ids, config.with_(do_sample=False), tokenizer=tokenizer, cache=cache)
    scores = [continuation_logprobs(model, r.prompt_ids, r.token_ids).sum().item()
              / (len(r.token_ids) ** length_penalty) for r in out.rows]
    return BeamSearchOutput(out.rows, out.stats, scores)
