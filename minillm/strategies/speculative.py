"""Speculative decoding: guess several tokens cheaply, let the target check them in one forward.

At batch 1 a decode step is bound by reading the weights, not by arithmetic: a forward
over k + 1 positions costs little more than a forward over one. So a cheap *drafter*
proposes k tokens, the target scores all of them at once, and we keep the longest
prefix the target agrees with plus one token of the target's own:

    sequence ... x          drafter proposes d1 d2 d3 d4
    target forward over     [x, d1, d2, d3, d4]   ->  p0 p1 p2 p3 p4   (one call, cache grows by 5)
    accept d1, d2; reject d3  ->  emit d1, d2 and a token drawn from p2; crop the cache back

Every round emits between 1 and k + 1 tokens for one target forward, and the tokens
are exactly those the target alone would have produced:

- Greedy: a drafted token is accepted while it equals the target's argmax; the first
  mismatch is replaced by the argmax. Output is identical to plain greedy decoding.
- Sampling (Leviathan et al. 2023; Chen et al. 2023): accept drafted token x with
  probability min(1, p(x)/q(x)); on rejection draw from normalise(max(0, p - q)); after
  a fully accepted draft draw a bonus token from p. The emitted token is distributed
  exactly as p: P(y) = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y). p and q are the
  target's and the drafter's distributions after the same logits processors plain
  sampling uses (`minillm.decoding.sampling.process_logits`). A deterministic drafter has a
  one-hot q, so the rule becomes "accept x with probability p(x), else draw from p
  without x".

Drafters share one small interface (`begin`, `propose`, `rollback`): `DraftModel` (any
minillm model with the target's tokenizer, running its own KV cache) and `PromptLookup`
(no model at all: find the context's last n-gram earlier in the context and propose
what followed it, which pays off when the output copies from the input).

The cost model. With acceptance rate a per drafted token (each accepted independently)
and k drafted tokens, a round emits on average (1 - a^(k+1)) / (1 - a) tokens. If a
draft forward costs c target forwards (and a (k+1)-token verify costs one), a round
costs k c + 1, so the expected speedup over plain decoding is
(1 - a^(k+1)) / ((1 - a)(k c + 1)).

Batch 1 only, like transformers' assisted generation; and the context window does not
slide: prompt + max_new_tokens must fit the model's block size.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..decoding.outputs import (
    GenerationOutput,
    GenerationStats,
    RowOutput,
    check_prompts,
    drain,
    encode_prompts,
)
from ..decoding.sampling import (
    SamplingConfig,
    TokenHistory,
    choose_next,
    process_logits,
    sample_from_probs,
)
from ..model.loading import resolve_dtype
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from ..runtime.session import Tree
from ..speed.load import load_model

DRAFTERS = ("model", "prompt-lookup")


# ------------------------------------------------------------------ the acceptance rule


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p/q) elementwise: how likely a token drafted from q survives a target with p."""
    return torch.where(q > 0, (p / q).clamp(max=1.0), torch.ones_like(p))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)): where to draw from after a rejection (the mass q lacks)."""
    residual = (p - q).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # A rejection implies p(x) < q(x), hence mass elsewhere; only rounding can leave none.
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def verify_token(target_logits: torch.Tensor, draft_token: int, q: torch.Tensor | None, config: SamplingConfig,
                 generator: torch.Generator | None) -> tuple[int, bool]:
    """Judge one drafted token against the target's processed logits [V].

    Returns (the token to emit, whether it is the drafted one). q [V] is the drafter's
    distribution; None means a deterministic drafter (q is one-hot on `draft_token`).
    """
    if config.greedy:
        best = int(target_logits.argmax())
        return best, best == draft_token
    p = target_logits.softmax(-1)
    if q is None:
        q = torch.zeros_like(p)
        q[draft_token] = 1.0
    u = torch.rand((), generator=generator, device=generator.device)
    if u < acceptance_probability(p[draft_token], q[draft_token]):
        return draft_token, True
    return int(sample_from_probs(residual_distribution(p, q)[None], [generator])), False


def expected_tokens_per_round(acceptance_rate: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens one target forward yields, drafts accepted independently."""
    a = acceptance_rate
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def predicted_speedup(acceptance_rate: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over plain decoding when a draft forward costs `cost_ratio` target forwards
    and verifying k + 1 tokens costs `verify_cost` one-token target forwards (1 when weight
    reads dominate; more on a CPU, where k + 1 rows of arithmetic are not free)."""
    return expected_tokens_per_round(acceptance_rate, k) / (k * cost_ratio + verify_cost)


# ------------------------------------------------------------------ drafters


@dataclass
class Draft:
    """What a drafter proposes: a chain of tokens, or (with `parents`) a tree of them.

    parents[i] is the index of token i's parent in [last sequence token, *tokens]
    (0: the last sequence token, the tree's root); None means a chain (parents
    0, 1, 2, ...). A tree comes from a deterministic drafter (lesson 11's lookahead).
    """

    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), V] the drafter's probabilities; None: deterministic (one-hot)
    parents: list[int] | None = None

    def first(self, n: int) -> "Draft":
        """The first n tokens: a chain's prefix, or a tree's first n nodes (parents come first, so still a tree)."""
        if len(self.tokens) <= n:
            return self
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n],
                     None if self.parents is None else self.parents[:n])


class Drafter(Protocol):
    def begin(self, target, tokenizer, max_len: int) -> None:
        """Get ready for a new sequence of at most `max_len` tokens (and refuse an incompatible target)."""

    def propose(self, sequence: list[int], n: int, config: SamplingConfig, history: TokenHistory,
                generator: torch.Generator | None) -> Draft:
        """Up to n tokens that might follow `sequence` (n: the decoder's current budget). A drafter sure of
        more may return more; the decoder keeps at most its ceiling and what max_new_tokens leaves."""

    def rollback(self, sequence: list[int]) -> None:
        """Forget whatever was drafted beyond `sequence` (the target has decided)."""

    # Optional: `end(sequence, prompt_length)`, called once the sequence is finished, lets a drafter
    # that learns from outputs (lesson 11's lookahead) keep it.


def latest_earlier_occurrence(sequence: list[int], size: int, end: int | None = None) -> int | None:
    """The start of the most recent earlier occurrence of the `size` tokens before `end` (default: the
    sequence's last `size` tokens), or None."""
    end = len(sequence) if end is None else end
    tail = sequence[end - size:end]
    for start in range(end - size - 1, -1, -1):
        if sequence[start + size - 1] == tail[-1] and sequence[start:start + size] == tail:
            return start
    return None


# A verify forward reads every weight once whatever its length, so its first few extra tokens cost
# about nothing and only longer drafts make it dearer (lesson 11 measures where the curve bends).
# A drafter whose drafts are free to make (a lookup, not a model) drafts at least this many tokens
# even where they keep failing: fewer would save nothing.
FREE_DRAFT = 5


class PromptLookup:
    """Draft by copying: find the context's trailing n-gram earlier in the context
    (longest n first, most recent occurrence first) and propose the tokens that followed.

    Free to run, and right surprisingly often when the answer quotes, summarises or
    edits its input. (transformers' `prompt_lookup_num_tokens` uses the same idea with
    n up to 2 and the earliest occurrence.)
    """

    min_draft = FREE_DRAFT  # an adaptive budget's floor (see FREE_DRAFT)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes min={min_ngram}, max={max_ngram} are invalid: need 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, target, tokenizer, max_len):
        pass

    def propose(self, sequence, n, config, history, generator):
        for size in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            start = latest_earlier_occurrence(sequence, size)
            if start is not None:
                return Draft(sequence[start + size:start + size + n])
        return Draft([])

    def rollback(self, sequence):
        pass


class DraftModel:
    """A smaller model with the target's tokenizer drafts autoregressively, on its own runner and cache.

    Its cache always holds a prefix of the sequence (plus, while drafting, its own
    guesses): `rollback` forgets what the target rejected and `propose` first feeds the
    tokens it has not seen (the prompt on the first call, then the one or two tokens the
    target added).
    """

    def __init__(self, model, tokenizer=None, cache: str = "static"):
        self.model, self.tokenizer, self.cache_kind = model, tokenizer, cache
        self.runner = self.seq = None  # the draft's own runner, and its sequence: what the draft's cache holds

    @property
    def cached(self) -> list[int]:
        """The token ids the draft's cache holds."""
        return self.runner.held(self.seq) if self.seq is not None else []

    @property
    def cache(self):
        return self.runner.session.cache

    def begin(self, target, tokenizer, max_len):
        check_same_vocabulary(self.model, self.tokenizer, target, tokenizer)
        self.runner, self.seq = ModelRunner(self.model, cache=self.cache_kind, max_len=max_len), None

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens after the held ones; next-token logits [1, V]."""
        if self.seq is None:
            self.seq = Sequence.create(tokens, SamplingConfig(), vocab_size=self.model.config.vocab_size)
            return self.runner.prefill([self.seq])
        self.seq.tokens.extend(tokens)
        return self.runner.feed([self.seq], [tokens])[:, -1]

    def propose(self, sequence, n, config, history, generator):
        self.rollback(sequence)
        logits = self._forward(sequence[len(self.cached):])  # [1, V]
        history = history.select(torch.tensor([0], device=history.seen.device))  # a copy to extend with guesses
        tokens, qs = [], []
        for i in range(n):
            processed = process_logits(logits, config, history)  # [1, V], exactly as the target's p
            token = choose_next(processed, config, None if config.greedy else [generator])  # [1]
            if not config.greedy:
                qs.append(processed.softmax(-1)[0])
            history.add(token)
            tokens.append(int(token))
            if i + 1 < n:  # the last guess is fed next round, together with the target's token
                logits = self._forward([tokens[-1]])
        return Draft(tokens, torch.stack(qs) if qs else None)

    def rollback(self, sequence):
        keep = 0
        for cached_id, seq_id in zip(self.cached, sequence):
            if cached_id != seq_id:
                break
            keep += 1
        keep = min(keep, len(sequence) - 1)  # always leave the newest token to feed
        if keep < len(self.cached):
            self.runner.rollback([self.seq], [keep])
            del self.seq.tokens[keep:]


def check_same_vocabulary(draft, draft_tokenizer, target, target_tokenizer) -> None:
    """A draft must speak the target's token ids: same vocabulary size and, when both
    tokenizers are known, the same encoding of a probe text and the same EOS."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise ValueError(f"draft model has a vocabulary of {dv} tokens but the target has {tv}: "
                         f"use a draft that shares the target's tokenizer")
    if draft_tokenizer is None or target_tokenizer is None or draft_tokenizer is target_tokenizer:
        return
    probe = "Speculative decoding: 12345 tokens, déjà vu, 東京 <|endoftext|> <|im_end|>"
    if (draft_tokenizer.encode(probe) != target_tokenizer.encode(probe)
            or getattr(draft_tokenizer, "eos_token_id", None) != getattr(target_tokenizer, "eos_token_id", None)):
        raise ValueError("draft model's tokenizer differs from the target's (a probe text encodes differently): "
                         "use a draft that shares the target's tokenizer")


def truncated_draft(model, n_layer: int):
    """The target's first `n_layer` blocks plus its final norm and LM head, sharing its weights.

    An untrained "early exit": no extra memory, a cost roughly proportional to the
    layers kept (plus the LM head), and an acceptance rate that says how much of the
    answer the early layers already know.
    """
    total = model.config.n_layer
    if not 1 <= n_layer <= total:
        raise ValueError(f"draft layers={n_layer} is invalid: the target has {total} blocks; keep 1..{total}")
    config = replace(model.config, n_layer=n_layer)
    with torch.device("meta"):
        draft = type(model)(config)
    draft.tok_emb, draft.pos_emb, draft.norm_f, draft.lm_head = model.tok_emb, model.pos_emb, model.norm_f, model.lm_head
    draft.blocks = torch.nn.ModuleList(model.blocks[:n_layer])
    return draft.eval()


def load_draft(spec: str, target, dtype="float32", device="cpu"):
    """`--draft-model` values: 'layers:N' (the target's first N blocks), 'dtype:bfloat16'
    (the target's weights in another precision), or any name/path `load_model` takes.
    Returns (draft model, its tokenizer or None when it is the target's)."""
    if spec.startswith("layers:"):
        try:
            n_layer = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--draft-model {spec!r} is invalid: write layers:N with N an integer") from None
        return truncated_draft(target, n_layer), None
    if spec.startswith("dtype:"):
        return copy.deepcopy(target).to(resolve_dtype(spec.split(":", 1)[1])).eval(), None
    return load_model(spec, dtype=dtype, device=device)


def make_drafter(kind: str, target, draft_model: str | None = None, dtype="float32", device="cpu") -> Drafter:
    """The CLI's drafter: 'prompt-lookup', or 'model' with a `load_draft` spec."""
    if kind == "prompt-lookup":
        if draft_model is not None:
            raise ValueError("--draft-model is only used with --speculative model")
        return PromptLookup()
    if kind == "model":
        if draft_model is None:
            raise ValueError("--speculative model needs --draft-model (a model name or path, or layers:N for the "
                             "target's first N blocks)")
        return DraftModel(*load_draft(draft_model, target, dtype, device))
    raise ValueError(f"--speculative {kind!r} is invalid: use one of {', '.join(DRAFTERS)} "
                     "(lookahead drafts come from minillm.strategies.lookahead.Lookahead)")


def independent_stream(generator: torch.Generator) -> torch.Generator:
    """A new generator seeded from a copy of `generator`'s state, leaving `generator` untouched."""
    copy_ = torch.Generator(generator.device)
    copy_.set_state(generator.get_state())
    return torch.Generator(generator.device).manual_seed(int(torch.randint(0, 2**62, (), generator=copy_)))


def check_num_draft_tokens(k, name: str = "num_draft_tokens") -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{name}={k!r} is invalid: must be an integer >= 1 (tokens drafted per round)")


# ------------------------------------------------------------------ the decode loop


@dataclass
class Round:
    drafted: list[int]  # what the drafter proposed (a tree's nodes, root excluded)
    accepted: int  # how many of them the target kept (a prefix, or a path from the tree's root)
    emitted: list[int]  # the tokens added: the accepted prefix and the target's own token (cut at a stop)
    depth: int = 0  # the draft's longest chain


class SpeculativeDecoder:
    """One prompt, one target, one drafter. `prefill()` emits the first token; each
    `round()` drafts, verifies with one target forward, emits 1..k+1 tokens and rolls
    both caches back to exactly the tokens kept.

    Invariant between rounds: the target's cache holds every token of `sequence` but
    the last one (whose logits are what the next verify forward starts from).
    """

    def __init__(self, model, drafter: Drafter, prompt_ids: list[int], config: SamplingConfig, *,
                 num_draft_tokens: int | None = None, tokenizer=None, cache: str = "static",
                 adaptive: bool | None = None):
        """num_draft_tokens: the most tokens one round drafts (a tree's nodes); adaptive: let the
        budget follow what the target accepts, below that ceiling (`_count_depths`), so text where
        drafts fail costs little. Left as None, both come from the drafter when it says (`max_draft`,
        `adaptive`: lookahead's decoding length, adaptive), else 4 and fixed. The adaptive budget
        never drops below the drafter's `min_draft` (1 unless it says): see `FREE_DRAFT`."""
        num_draft_tokens = getattr(drafter, "max_draft", 4) if num_draft_tokens is None else num_draft_tokens
        adaptive = getattr(drafter, "adaptive", False) if adaptive is None else adaptive
        check_num_draft_tokens(num_draft_tokens)
        if cache not in ("static", "dynamic"):
            raise ValueError(f"cache={cache!r}: speculative decoding rolls back a KV cache; use 'static' or 'dynamic'")
        block = model.config.block_size
        if len(prompt_ids) + config.max_new_tokens > block:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceed the "
                             f"model's context of {block}: speculative decoding does not slide the window; "
                             f"shorten the prompt or lower max_new_tokens")
        if config.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=...")
        self.model, self.drafter, self.config, self.k = model, drafter, config, num_draft_tokens
        # The drafters read the penalties' history whatever the settings: the sequence always keeps one.
        self.seq = Sequence.create(prompt_ids, config, tokenizer=tokenizer, vocab_size=model.config.vocab_size,
                                   device=model.device, history=True, id=0)
        max_len = len(prompt_ids) + config.max_new_tokens
        self.runner = ModelRunner(model, cache=cache, max_len=max_len)
        drafter.begin(model, tokenizer, max_len)
        self.target_generator = self.seq.generator
        self.generators = None if self.target_generator is None else [self.target_generator]
        # The drafter's random stream must be independent of the target's, and seeding it must not
        # consume the target's: a tree round then draws exactly what plain sampling draws.
        self.draft_generator = None if self.target_generator is None else independent_stream(self.target_generator)
        self.drafted = self.accepted = self.verify_forwards = self.fed = 0
        self.draft_seconds = 0.0
        self.adaptive, self.budget = adaptive, num_draft_tokens
        self.min_draft = min(getattr(drafter, "min_draft", 1), num_draft_tokens)  # the adaptive budget's floor
        self.pause = self.paused = 0  # adaptive: plain steps to take before drafting again; the last pause's length
        self.reached: dict[int, int] = {}  # depth -> rounds whose draft reached it
        self.kept: dict[int, int] = {}  # depth -> rounds that accepted a token at it

    @property
    def finished(self) -> bool:
        return self.seq.finished

    @property
    def state(self):
        return self.seq.state

    @property
    def sequence(self) -> list[int]:
        """Prompt and every token emitted so far (what the drafters read)."""
        return self.seq.tokens

    @property
    def history(self):
        return self.seq.history

    @property
    def cache(self):
        return self.runner.session.cache

    def _emit(self, token: int) -> None:
        self.seq.append(token)

    @torch.inference_mode()
    def prefill(self) -> int:
        """Forward the prompt, emit the first token exactly as plain decoding does."""
        logits = self.runner.prefill([self.seq])  # [1, V]
        token = int(choose_next(process_logits(logits, self.config, self.history), self.config, self.generators))
        self._emit(token)
        return token

    @torch.inference_mode()
    def round(self) -> Round:
        """Draft up to `budget` tokens, verify them in one target forward, keep the agreed prefix + one."""
        remaining = self.config.max_new_tokens - len(self.state.token_ids)
        most = min(self.k, remaining - 1)  # a round emits at most one token more than it drafts
        n = 0 if self.pause else min(self.budget, most)
        self.pause = max(0, self.pause - 1)
        start = time.perf_counter()
        draft = (self.drafter.propose(self.sequence, n, self.config, self.history, self.draft_generator).first(most)
                 if n > 0 else Draft([]))
        self.draft_seconds += time.perf_counter() - start
        if draft.parents is not None:
            result = self._verify_tree(draft)
        else:
            result = self._verify_chain(draft)
        self.verify_forwards += 1
        self.drafted += len(result.drafted)
        self.accepted += result.accepted
        self._count_depths(result)
        self.drafter.rollback(self.sequence)
        return result

    def _verify_chain(self, draft: Draft) -> Round:
        """k drafted tokens in a row: accept while the target agrees (lesson 08's rule), then crop."""
        drafted = draft.tokens
        logits = self.runner.verify([self.seq], [drafted])[0]  # [k + 1, V]: p after each verified token
        self.fed += len(drafted) + 1
        emitted, accepted = [], 0
        for i in range(len(drafted) + 1):
            processed = process_logits(logits[i:i + 1], self.config, self.history)[0]  # history = tokens so far
            if i < len(drafted):
                q = draft.q[i] if draft.q is not None else None
                token, ok = verify_token(processed, drafted[i], q, self.config, self.target_generator)
            else:  # every draft accepted: a bonus token from the target's last distribution
                token, ok = int(choose_next(processed[None], self.config, self.generators)), False
            accepted += ok
            self._emit(token)
            emitted.append(token)
            if self.finished or not ok:
                break
        self.runner.rollback([self.seq])  # drop the rejected drafts' keys and values
        return Round(drafted, accepted, emitted, depth=len(drafted))

    def _verify_tree(self, draft: Draft) -> Round:
        """A token tree: one forward scores every node; from the root, the target chooses its own
        token at each node (argmax, or a draw from its processed distribution, exactly as plain
        decoding) and we move to the child holding that token, until no child does.

        Each emitted token is the target's own choice given the tokens before it, so the output
        is exactly plain decoding's; the drafts only decide how many choices one forward makes.
        The cache then keeps the prefix and the accepted path, nothing else.
        """
        parents = [-1, *draft.parents]
        tree = Tree.from_parents(parents)
        before = len(self.sequence) - 1  # tokens the cache holds; the root is the sequence's last token
        logits = self.runner.verify([self.seq], [draft.tokens], tree)[0]  # [T, V]: p at each node
        self.fed += len(parents)
        children: dict[int, dict[int, int]] = {}
        for node, parent in enumerate(parents[1:], start=1):
            children.setdefault(parent, {}).setdefault(draft.tokens[node - 1], node)
        path, emitted, node = [0], [], 0
        while True:
            processed = process_logits(logits[node:node + 1], self.config, self.history)
            token = int(choose_next(processed, self.config, self.generators))
            self._emit(token)
            emitted.append(token)
            node = children.get(node, {}).get(token)
            if node is None or self.finished:
                break
            path.append(node)
        keep = path[: len(self.sequence) - 1 - before]  # the cache holds every token but the newest
        self.runner.keep_path(self.seq, list(range(before)) + [before + i for i in keep])
        return Round(draft.tokens, len(emitted) - 1 if node is None else len(emitted), emitted,
                     depth=int(tree.depth.max()))

    def _count_depths(self, result: Round) -> None:
        """Acceptance per depth; and the adaptive budget, after a round that accepted
        - its draft's whole depth: double it (up to the ceiling k);
        - part of it: twice what was accepted, or half the budget if that is more;
        - nothing of several drafted tokens: halve it;
        - nothing of a single drafted token: pause drafting for 1, 2, 4 ... 16 plain steps (twice the last
          pause, until a draft is accepted), since on a CPU even one extra token may make a forward dearer;
        never below the drafter's `min_draft`: a drafter whose drafts cost nothing to make says how many
        tokens a verify forward checks at about the price of a plain step, and it never pauses."""
        for d in range(1, result.depth + 1):
            self.reached[d] = self.reached.get(d, 0) + 1
            self.kept[d] = self.kept.get(d, 0) + (result.accepted >= d)
        if self.adaptive and result.depth:
            if result.accepted >= result.depth:
                budget = 2 * self.budget
            elif result.accepted:
                budget = max(2 * result.accepted, self.budget // 2)
            elif self.budget == 1:
                budget = 1
                self.pause = self.paused = min(16, 2 * self.paused or 1)
            else:
                budget = self.budget // 2
            self.budget = min(self.k, max(self.min_draft, budget))
            if result.accepted:
                self.paused = 0

    def stats_extra(self) -> dict:
        emitted_in_rounds = len(self.state.token_ids) - 1
        return {
            "num_draft_tokens": self.k, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "verify_forwards": self.verify_forwards,
            "tokens_per_target_forward": emitted_in_rounds / self.verify_forwards if self.verify_forwards else None,
            "tokens_fed_per_forward": self.fed / self.verify_forwards if self.verify_forwards else None,
            "draft_seconds": self.draft_seconds,
            "acceptance_by_depth": {d: self.kept[d] / self.reached[d] for d in sorted(self.reached)},
        }


class SpeculativeGeneration:
    """One speculative run as a stream of events (one per round); `output` once it is done."""

    def __init__(self, model, prompt, drafter: Drafter, config=None, *, num_draft_tokens: int | None = None,
                 tokenizer=None, cache: str = "static", adaptive: bool | None = None, **config_overrides):
        config = (config or SamplingConfig()).with_(**config_overrides)
        rows = encode_prompts(prompt, tokenizer)
        if len(rows) != 1:
            raise ValueError(f"speculative decoding takes one prompt at a time (got {len(rows)}): call it per prompt")
        check_prompts(rows, model.config.block_size, model.config.vocab_size)
        self.decoder = SpeculativeDecoder(model, drafter, rows[0], config, num_draft_tokens=num_draft_tokens,
                                          tokenizer=tokenizer, cache=cache, adaptive=adaptive)
        self.prompt_length = len(rows[0])
        self.stats = GenerationStats(prompt_tokens=len(rows[0]))
        self.output: GenerationOutput | None = None

    def __iter__(self):
        decoder, state, stats = self.decoder, self.decoder.state, self.stats
        if not decoder.finished:  # max_new_tokens == 0 finishes before the first token
            t_start = time.perf_counter()
            token = decoder.prefill()
            t_first = time.perf_counter()
            stats.prefill_seconds = t_first - t_start
            yield decoder.seq.event([token])
            while not decoder.finished:
                emitted = decoder.round().emitted
                yield decoder.seq.event(emitted)
            stats.decode_seconds = time.perf_counter() - t_first
            stats.decode_tokens = len(state.token_ids) - 1
            stats.forward_passes = 1 + decoder.verify_forwards
            stats.extra.update(decoder.stats_extra())
            if hasattr(decoder.drafter, "end"):
                decoder.drafter.end(decoder.sequence, self.prompt_length)
        else:
            yield decoder.seq.event([])
        self.output = GenerationOutput([RowOutput.from_state(state)], stats)


def speculative_generate(model, prompt, drafter: Drafter, config: SamplingConfig | None = None, *,
                         num_draft_tokens: int | None = None, tokenizer=None, cache: str = "static",
                         streamer=None, stream: bool = False, adaptive: bool | None = None, **config_overrides):
    """`minillm.strategies.generate.generate` for one prompt, sped up by a drafter; same outputs, same stats,
    plus stats.extra: drafted, accepted, acceptance_rate, tokens_per_target_forward.

        out = speculative_generate(model, "Repeat: ...", PromptLookup(), tokenizer=tok, num_draft_tokens=8)

    With stream=True returns the SpeculativeGeneration to iterate over (one event per round).
    """
    run = SpeculativeGeneration(model, prompt, drafter, config, num_draft_tokens=num_draft_tokens,
                                tokenizer=tokenizer, cache=cache, adaptive=adaptive, **config_overrides)
    return run if stream else drain(run, streamer)


__all__ = [
    "speculative_generate", "SpeculativeGeneration", "SpeculativeDecoder", "Round", "Draft", "Drafter",
    "PromptLookup", "latest_earlier_occurrence", "DraftModel", "truncated_draft", "load_draft", "make_drafter", "check_same_vocabulary",
    "check_num_draft_tokens", "acceptance_probability", "residual_distribution", "verify_token",
    "expected_tokens_per_round", "predicted_speedup", "DRAFTERS",
]
