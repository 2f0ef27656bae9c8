"""One request's whole life: its tokens, settings, random stream, stop state, place in the cache and timings.

Every path that decodes (`generate`, speculative decoding, lookahead, the continuous-batching
engine and the server) keeps its requests as `Sequence`s and reports through `Sequence.event`,
so a request's life is written once (nano-vllm's shape):

    seq = Sequence.create(prompt_ids, config, tokenizer=tok, vocab_size=V, device=model.device)
    logits = runner.prefill([seq])                     # the runner feeds seq.window()
    token = sample_next([seq], logits)[0]              # with seq's own settings and random stream
    seq.append(token)                                  # stop state, penalties' history, timings
    event = seq.event([token])                         # what streamers, the CLI and the server adapt

A sequence's tokens depend only on its prompt, settings and seed, never on which other
sequences share its forwards: its generator and its penalties' history are its own.

Logprobs (the server's `logprobs`, `echo`): a sequence made with `top_logprobs=k` has
`sample_next` record each chosen token's logprob and the k likeliest tokens' in
`seq.logprobs`, from the distribution the token was drawn from; one made with
`prompt_top_logprobs=k` has the engine record its prompt tokens' in `seq.prompt_logprobs`
(`score_prompt`). Which distribution, and what it costs: `minillm.decoding.logprobs`.
Sequences that ask for neither compute nothing more.

Structured output (lesson 18): a sequence whose settings carry `json_schema` or `regex` holds a
`Constraint` (`minillm.decoding.structured`): `sample_next` masks its row to the tokens that keep
its text inside the language, `append` walks the chosen token through the automaton, and the
sequence stops ("stop") as soon as its text is whole and nothing may follow it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from ..decoding.logprobs import TokenLogprobs, token_logprobs
from ..decoding.outputs import GenerationEvent, RowOutput
from ..decoding.sampling import (SamplingConfig, TokenHistory, check_logit_bias, choose_rows, generators_for,
                                 process_rows)
from ..decoding.stopping import RowState
from ..decoding.structured import Constraint, constraint_for

_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A prompt and everything generated for it; see the module docstring."""

    prompt_ids: list[int]
    config: SamplingConfig
    state: RowState  # generated ids, final text, finish reason
    generator: torch.Generator | None  # its own random stream (None when greedy)
    history: TokenHistory | None  # what its penalties read: [1, V] tables (None without penalties)
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)  # prompt + generated: every token the sequence holds
    window_start: int = 0  # the first token the model sees (the context window slides past the model's length)
    computed: int = 0  # leading tokens whose keys are in a paged cache (the engine's bookkeeping)
    preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # when each generated token was produced
    finish_time: float | None = None
    top_logprobs: int | None = None  # report each generated token's logprob and this many likeliest (None: none)
    prompt_top_logprobs: int | None = None  # the same for each prompt token after the first (None: none)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per generated token, when top_logprobs is set
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1, 2, ... scored so far
    constraint: Constraint | None = None  # structured output: where its text stands in its automaton

    @classmethod
    def create(cls, prompt_ids: list[int], config: SamplingConfig, *, tokenizer=None, vocab_size: int,
               device=None, history: bool | None = None, **fields) -> "Sequence":
        """A new sequence. history: keep the penalties' tables (default: when the config uses penalties)."""
        keep_history = config.uses_penalties if history is None else history
        check_logit_bias(config, vocab_size)
        (generator,) = generators_for([config], device)
        return cls(list(prompt_ids), config, RowState.for_config(prompt_ids, config, tokenizer), generator,
                   TokenHistory.from_prompts([prompt_ids], vocab_size, device) if keep_history else None,
                   tokens=list(prompt_ids), constraint=constraint_for(config, tokenizer, vocab_size), **fields)

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def generated(self) -> list[int]:
        return self.state.token_ids

    @property
    def max_new_tokens(self) -> int:
        return self.state.max_new_tokens

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether prompt tokens still wait for their logprobs: the logits at every prompt position are
        needed, so none of its keys may come from the prefix cache (the scheduler asks)."""
        return self.prompt_top_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    def prompt_positions_to_score(self, start: int, n: int) -> range:
        """Of the positions start .. start + n - 1 about to be fed, those whose logits score a prompt token
        not scored yet (position p's logits score token p + 1); empty unless prompt logprobs are asked."""
        if self.prompt_top_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(start + n, len(self.prompt_ids) - 1))

    def score_prompt(self, logits: torch.Tensor) -> None:
        """Record the next len(logits) prompt tokens' logprobs from the model's raw logits [K, V] at the
        positions before them (`prompt_positions_to_score` says which)."""
        first = len(self.prompt_logprobs) + 1
        targets = torch.tensor(self.prompt_ids[first : first + len(logits)], device=logits.device)
        self.prompt_logprobs += token_logprobs(logits, targets, [self.prompt_top_logprobs] * len(logits))

    def window(self) -> list[int]:
        """The tokens the model sees: everything from the context window's start."""
        return self.tokens[self.window_start:]

    def append(self, token: int) -> None:
        """Add one generated token: stop state, penalties' history and timings follow."""
        now = time.perf_counter()
        self.tokens.append(token)
        self.token_times.append(now)
        if self.history is not None:
            self.history.add(torch.tensor([token], device=self.history.seen.device))
        if self.constraint is not None:
            self.constraint.advance(token)
        self.state.push(token)
        if self.constraint is not None and not self.state.finished and self.constraint.complete:
            self.state.end("stop")  # the text is whole: nothing but EOS could follow
        if self.state.finished:
            self.finish_time = now

    def finish(self, reason: str) -> None:
        """End the sequence from outside (the engine's "abort")."""
        self.state.finish_reason = reason
        self.finish_time = time.perf_counter()

    def event(self, token_ids: list[int]) -> GenerationEvent:
        """The one report every path gives: these new tokens, the text they made final, the finish reason;
        and, where asked, the tokens' logprobs and, on the first event, the prompt's."""
        first = len(self.generated) == len(token_ids)
        logprobs = None if self.top_logprobs is None else self.logprobs[len(self.logprobs) - len(token_ids):]
        prompt_logprobs = self.prompt_logprobs if self.prompt_top_logprobs is not None and first else None
        return GenerationEvent(self.id, token_ids, self.state.new_text(), self.state.finish_reason, logprobs,
                               prompt_logprobs)

    def output(self) -> RowOutput:
        return RowOutput.from_state(self.state)


def stacked_history(seqs: list[Sequence]) -> TokenHistory | None:
    """The penalties' tables of a batch [B, V] (rows without penalties read zeros their config ignores)."""
    if all(s.history is None for s in seqs):
        return None
    with_history = next(s.history for s in seqs if s.history is not None)
    empty = TokenHistory(torch.zeros_like(with_history.seen), torch.zeros_like(with_history.generated_counts))
    rows = [s.history or empty for s in seqs]
    return TokenHistory(torch.cat([h.seen for h in rows]), torch.cat([h.generated_counts for h in rows]))


def stacked_masks(seqs: list[Sequence], vocab_size: int) -> torch.Tensor | None:
    """bool [B, V]: the tokens each sequence's constraint allows (all, for a sequence without); None if none has one."""
    if all(s.constraint is None for s in seqs):
        return None
    allowed = torch.ones(len(seqs), vocab_size, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        if seq.constraint is not None:
            allowed[row] = seq.constraint.mask()
    return allowed


def sample_next(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Next-token logits [B, V] -> one token per sequence, each with its own settings and random stream.

    A sequence with `top_logprobs` set gets the chosen token's logprobs appended to `seq.logprobs`, from the
    processed logits the token was drawn from (`minillm.decoding.logprobs` says why those).
    """
    configs = [s.config for s in seqs]
    allowed = stacked_masks(seqs, logits.shape[-1])
    processed = process_rows(logits, configs, stacked_history(seqs), allowed)  # float32 [B, V]
    tokens = choose_rows(processed, configs, [s.generator for s in seqs])  # [B]
    asking = [i for i, s in enumerate(seqs) if s.top_logprobs is not None]
    if asking:
        rows = torch.tensor(asking, device=tokens.device)
        for i, report in zip(asking, token_logprobs(processed[rows], tokens[rows],
                                                    [seqs[i].top_logprobs for i in asking])):
            seqs[i].logprobs.append(report)
    return tokens.tolist()


__all__ = ["Sequence", "sample_next", "stacked_history", "stacked_masks"]
