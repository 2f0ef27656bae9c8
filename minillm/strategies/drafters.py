"""Drafters: cheap guesses for speculative decoding to verify (lessons 08 and 11).

Drafters share one small interface (`begin`, `propose`, `rollback`): `DraftModel` (any
minillm model with the target's tokenizer, on its own runner and KV cache) and
`PromptLookup` (no model at all: find the context's last n-gram earlier in the context
and propose what followed it, which pays off when the output copies from the input).
Lesson 11's lookahead (`minillm.strategies.lookahead`) drafts token trees through the same
interface.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..decoding.sampling import SamplingConfig, TokenHistory, choose_next, process_logits
from ..model.loading import resolve_dtype
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from ..speed.load import load_model

DRAFTERS = ("model", "prompt-lookup")


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

    # Optional: `confident(sequence) -> bool`, whether the context offers a match worth verifying: an
    # adaptive run with such a drafter drafts only then until a round pays (`SpeculativeDecoder._count_depths`).

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
# little and only longer drafts make it dearer (lesson 11 measures where the curve bends). A drafter
# whose drafts are free to make (a lookup, not a model) drafts at least this many tokens once it drafts
# at all: a shorter draft would cost nearly as much. Where even those keep failing, the adaptive budget
# pauses drafting and waits for a confident match (`SpeculativeDecoder._count_depths`), for a verify
# forward still costs more than a plain step. The 5 was set on an AVX-512 machine whose matrix library
# ran a 5-row forward about as fast as a 1-row one; the verify cost is a property of the machine
# (`verify_cost` in results/speculative.json). Measure before changing it.
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

    def confident(self, sequence) -> bool:
        """The context's last `max_ngram` tokens occur earlier: a match long enough to draft from while drafts
        have not paid (a single shared token, the shortest match `propose` drafts from, is too common to be worth
        a forward)."""
        return len(sequence) > self.max_ngram and latest_earlier_occurrence(sequence, self.max_ngram) is not None

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


__all__ = ["Draft", "Drafter", "FREE_DRAFT", "PromptLookup", "latest_earlier_occurrence", "DraftModel", "truncated_draft", "load_draft", "make_drafter", "check_same_vocabulary", "DRAFTERS"]
