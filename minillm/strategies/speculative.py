"""Speculative decoding: guess several tokens cheaply, let the target check them in one forward.

At batch 1 a decode step is bound by reading the weights, not by arithmetic: a forward
over k + 1 positions costs little more than a forward over one. So a cheap *drafter*
(`minillm.strategies.drafters`) proposes k tokens, the target scores all of them at once,
and we keep the longest prefix the target agrees with plus one token of the target's own:

    sequence ... x          drafter proposes d1 d2 d3 d4
    target forward over     [x, d1, d2, d3, d4]   ->  p0 p1 p2 p3 p4   (one call, cache grows by 5)
    accept d1, d2; reject d3  ->  emit d1, d2 and a token drawn from p2; crop the cache back

Every round emits between 1 and k + 1 tokens for one target forward, and the tokens are
exactly those the target alone would have produced (the acceptance rule and what it buys:
`minillm.strategies.acceptance`). A draft may also be a tree of tokens (lesson 11's
lookahead), verified in one forward under a tree mask.

Batch 1 only, like transformers' assisted generation; and the context window does not
slide: prompt + max_new_tokens must fit the model's context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..decoding.outputs import GenerationOutput, GenerationStats, RowOutput, check_prompts, drain, encode_prompts
from ..decoding.sampling import SamplingConfig, choose_next, process_logits
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence
from ..runtime.session import Tree
from .acceptance import verify_token
from .drafters import Draft, Drafter


MAX_PAUSE = 16  # the most plain steps an adaptive run takes between drafts that keep failing
# The accepted tokens a round needs to pay for its verify forward: through the kept graphs an 8-token verify costs
# one and a half to three decode steps on the 2-core AMD EPYC with AVX-512 (the `cli` suite's copy-heavy rounds 1.5;
# 23.3 against 8.0 ms in an hour when the decode step ran faster and the verify's arithmetic did not), so a round
# that accepts one token pays little or nothing and one that accepts two pays in either hour. A draft shorter than
# this pays when all of it is accepted.
PAYING_ACCEPTS = 2


def can_be_confident(drafter: Drafter) -> bool:
    """Whether the drafter says when the context offers a match worth a verify forward (its optional `confident`)."""
    return callable(getattr(drafter, "confident", None))


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
                 adaptive: bool | None = None, compile: bool | None = None):
        """num_draft_tokens: the most tokens one round drafts (a tree's nodes); adaptive: let the
        budget follow what the target accepts, below that ceiling (`_count_depths`), so text where
        drafts fail costs little. Left as None, both come from the drafter when it says (`max_draft`,
        `adaptive`: lookahead's decoding length, adaptive), else 4 and fixed. The adaptive budget
        shrinks to the drafter's `min_draft` (1 unless it says: see `FREE_DRAFT`), then pauses drafting
        (`_count_depths`). compile: as `generate`'s (None: the kept graphs when built; a verify graph
        not built leaves the drafting rounds eager), with a verify graph for k + 1 tokens beside decode's."""
        num_draft_tokens = getattr(drafter, "max_draft", 4) if num_draft_tokens is None else num_draft_tokens
        adaptive = getattr(drafter, "adaptive", False) if adaptive is None else adaptive
        check_num_draft_tokens(num_draft_tokens)
        if cache not in ("static", "dynamic"):
            raise ValueError(f"cache={cache!r}: speculative decoding rolls back a KV cache; use 'static' or 'dynamic'")
        context = model.config.context_length
        if len(prompt_ids) + config.max_new_tokens > context:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceed the "
                             f"model's context of {context}: speculative decoding does not slide the window; "
                             f"shorten the prompt or lower max_new_tokens")
        if config.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=...")
        if config.constraint is not None:
            raise ValueError(f"{config.constraint[0]} (structured output) is not supported with speculative decoding "
                             f"or lookahead: use generate or the engine (the server)")
        self.model, self.drafter, self.config, self.k = model, drafter, config, num_draft_tokens
        # The drafters read the penalties' history whatever the settings: the sequence always keeps one.
        self.seq = Sequence.create(prompt_ids, config, tokenizer=tokenizer, vocab_size=model.config.vocab_size,
                                   device=model.device, history=True, id=0)
        max_len = len(prompt_ids) + config.max_new_tokens
        graph = {None: "auto", True: "compiled", False: "eager"}[compile if cache == "static" else False]
        self.runner = ModelRunner(model, cache=cache, graph=graph, max_len=max_len, verify_tokens=num_draft_tokens + 1)
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
        # adaptive, with a drafter that says when it is `confident`: draft only then, until a round pays
        self.cold = adaptive and can_be_confident(drafter)
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
        drafts = not self.pause and (not self.cold or self.drafter.confident(self.sequence))
        n = min(self.budget, most) if drafts else 0  # 0: a plain decode step (the decode graph, if kept)
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
        - nothing of a draft above the floor: halve it, never below the drafter's `min_draft` (a drafter
          whose drafts cost nothing to make says how many tokens are worth a verify forward once it runs);
        - too little of a draft at that floor to pay (fewer than `PAYING_ACCEPTS` tokens, or than it
          drafted): pause drafting for 1, 2, 4 ... `MAX_PAUSE` plain steps (twice the last pause, until a
          round pays), since a verify forward costs more than a plain step (lesson 08's break-even: a round
          must gain more tokens than its verify costs steps). A drafter that can say when it is
          `confident` (a long match in the context) also goes cold: it drafts only when confident until
          a round pays, so open text, where its shorter matches fail, costs few failed drafts (a cold
          run starts so: the first drafts wait for a match)."""
        for d in range(1, result.depth + 1):
            self.reached[d] = self.reached.get(d, 0) + 1
            self.kept[d] = self.kept.get(d, 0) + (result.accepted >= d)
        if self.adaptive and result.depth:
            paid = result.accepted >= min(PAYING_ACCEPTS, result.depth)
            if result.accepted >= result.depth:
                budget = 2 * self.budget
            elif result.accepted:
                budget = max(2 * result.accepted, self.budget // 2)
            else:
                budget = self.budget // 2
            if not paid and self.budget <= self.min_draft:  # the smallest draft did not pay: pause, go cold
                self.pause = self.paused = min(MAX_PAUSE, 2 * self.paused or 1)
                self.cold = can_be_confident(self.drafter)
            self.budget = min(self.k, max(self.min_draft, budget))
            if paid:
                self.paused, self.cold = 0, False

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
                 tokenizer=None, cache: str = "static", adaptive: bool | None = None, compile: bool | None = None,
                 **config_overrides):
        config = (config or SamplingConfig()).with_(**config_overrides)
        rows = encode_prompts(prompt, tokenizer)
        if len(rows) != 1:
            raise ValueError(f"speculative decoding takes one prompt at a time (got {len(rows)}): call it per prompt")
        check_prompts(rows, model.config.context_length, model.config.vocab_size)
        self.decoder = SpeculativeDecoder(model, drafter, rows[0], config, num_draft_tokens=num_draft_tokens,
                                          tokenizer=tokenizer, cache=cache, adaptive=adaptive, compile=compile)
        self.prompt_length = len(rows[0])
        runner = self.decoder.runner
        self.stats = GenerationStats(prompt_tokens=len(rows[0]), build_seconds=runner.build_seconds,
                                     extra=runner.graph_stats())
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
                         streamer=None, stream: bool = False, adaptive: bool | None = None, compile: bool | None = None,
                         **config_overrides):
    """`minillm.strategies.generate.generate` for one prompt, sped up by a drafter; same outputs, same stats,
    plus stats.extra: drafted, accepted, acceptance_rate, tokens_per_target_forward.

        out = speculative_generate(model, "Repeat: ...", PromptLookup(), tokenizer=tok, num_draft_tokens=8)

    With stream=True returns the SpeculativeGeneration to iterate over (one event per round). compile: as
    `generate`'s; the target then verifies through a kept graph for the round's k + 1 tokens.
    """
    run = SpeculativeGeneration(model, prompt, drafter, config, num_draft_tokens=num_draft_tokens,
                                tokenizer=tokenizer, cache=cache, adaptive=adaptive, compile=compile,
                                **config_overrides)
    return run if stream else drain(run, streamer)


__all__ = ["speculative_generate", "SpeculativeGeneration", "SpeculativeDecoder", "Round", "independent_stream",
           "check_num_draft_tokens", "can_be_confident", "MAX_PAUSE", "PAYING_ACCEPTS"]
