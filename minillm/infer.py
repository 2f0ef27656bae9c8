"""The generation loop: prefill once, then one token per step, until every row stops.

    from minillm import load_model
    from minillm.infer import generate
    model, tok = load_model("default")
    out = generate(model, ["The capital of France is"], tokenizer=tok, max_new_tokens=20)
    out.rows[0].text, out.rows[0].finish_reason, out.stats.decode_tokens_per_second

Prompts of different lengths are left-padded into one batch (`minillm.batching`);
each row stops on its own (`minillm.stopping`); the KV cache (`minillm.kv_cache`)
turns each decode step into a one-token forward.

The context window. A model only knows `block_size` positions. When a row outgrows
it, its window (the tokens the model sees) moves forward by `window_slide` tokens
and the batch is prefilled again from the new windows. The rule is the same with
and without a cache, so all cache kinds give the same tokens; sliding by more than
one token at a time means fewer re-prefills for a little less context.

Run as `python -m minillm.infer --prompt "..."` for the command-line interface
(`minillm.cli`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .batching import attention_mask, pad_left
from .kv_cache import make_cache
from .sampling import SamplingConfig, TokenHistory, choose_next, process_logits, row_generators
from .stopping import RowState, eos_ids


@dataclass
class RowOutput:
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, including the EOS or stop-completing token
    text: str  # generated text without EOS and without the stop string
    finish_reason: str  # "eos", "stop" or "length"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # real (unpadded) prompt tokens over all rows
    prefill_seconds: float = 0.0  # from the call to the first token of every row (time to first token)
    decode_tokens: int = 0  # tokens produced after each row's first one
    decode_seconds: float = 0.0
    forward_passes: int = 0  # model calls, prefills included
    extra: dict = field(default_factory=dict)  # what later lessons add (speculative: drafted, accepted, ...)

    @property
    def time_to_first_token(self) -> float:
        return self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(extra=dict(self.extra), time_to_first_token=self.time_to_first_token,
                 decode_tokens_per_second=self.decode_tokens_per_second)
        return d


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
    """A string, a list of ids, or a list of either -> one id list per row."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    rows = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass tokenizer=... or token ids")
            p = tokenizer.encode(p)
        rows.append([int(i) for i in p])
    if not rows:
        raise ValueError("no prompts given: pass at least one prompt")
    return rows


def check_prompts(rows: list[list[int]], block_size: int, vocab_size: int) -> None:
    for i, ids in enumerate(rows):
        if not ids:
            raise ValueError(f"prompt {i} is empty: give it at least one token")
        if len(ids) > block_size:
            raise ValueError(f"prompt {i} has {len(ids)} tokens but the model's context is {block_size}: shorten it")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} holds a token id outside the vocabulary [0, {vocab_size})")


def sliding_window_start(length: int, start: int, block_size: int, slide: int) -> int:
    """Where a row's window begins once it holds `length` tokens: unchanged while it fits,
    else moved forward by `slide` (at least far enough to fit)."""
    if length - start <= block_size:
        return start
    return max(start + slide, length - block_size)


class _Batch:
    """The rows still generating and the tensors that follow them through the loop."""

    def __init__(self, model, rows, sequences, starts, cache):
        self.model, self.rows, self.cache = model, rows, cache
        self.sequences, self.starts = sequences, starts

    def prefill(self):
        """Forward every active row's window; returns next-token logits [B, V]."""
        windows = [self.sequences[r][self.starts[r]:] for r in self.rows]
        tokens, self.key_valid, positions = pad_left(windows, device=self.model.device)
        self.padded = not bool(self.key_valid.all())
        self.next_positions = positions[:, -1] + 1  # [B]
        if self.cache is not None:
            self.cache.crop(0)
            self.cache.reorder(torch.arange(len(self.rows)))
        mask = attention_mask(self.key_valid, tokens.shape[1]) if self.padded else None
        return self.model(tokens, positions, cache=self.cache, mask=mask, last_only=True)[:, -1]

    def step(self, next_tokens: torch.Tensor):
        """Forward one new token per row [B]; returns next-token logits [B, V]."""
        ones = torch.ones(len(self.rows), 1, dtype=torch.bool, device=self.key_valid.device)
        self.key_valid = torch.cat((self.key_valid, ones), dim=1)  # [B, S]
        mask = attention_mask(self.key_valid, 1) if self.padded else None
        positions = self.next_positions[:, None]
        self.next_positions = self.next_positions + 1
        return self.model(next_tokens[:, None], positions, cache=self.cache, mask=mask)[:, -1]

    def keep(self, keep: list[int]):
        """Drop finished rows: `keep` indexes the current batch."""
        index = torch.tensor(keep, device=self.key_valid.device)
        self.rows = [self.rows[i] for i in keep]
        self.key_valid, self.next_positions = self.key_valid[index], self.next_positions[index]
        if self.cache is not None:
            self.cache.reorder(index)
        return index


@torch.inference_mode()
def generate(model, prompts, config: SamplingConfig | None = None, *, tokenizer=None, cache: str = "static",
             streamer=None, window_slide: int = 1, **config_overrides) -> GenerationOutput:
    """Generate a continuation for each prompt.

    prompts: a string, a list of token ids, or a list of either (a batch).
    config: how to choose tokens; keyword arguments override its fields
        (`generate(..., max_new_tokens=20, do_sample=True, seed=0)`).
    tokenizer: needed for text prompts, text output, stop strings and streaming.
    cache: "static" (default), "dynamic", or "none" (recompute everything each step).
    streamer: an object with `put(row, text)` and `end()` that receives final text as it forms.
    window_slide: how far the context window moves when a row outgrows `block_size`.
    """
    config = (config or SamplingConfig()).with_(**config_overrides) if config_overrides else (config or SamplingConfig())
    if window_slide < 1:
        raise ValueError(f"window_slide={window_slide} is invalid: must be >= 1")
    block = model.config.block_size
    prompt_ids = encode_prompts(prompts, tokenizer)
    check_prompts(prompt_ids, block, model.config.vocab_size)
    wants_text = tokenizer is not None
    states = [RowState(ids, config.max_new_tokens, eos_ids(config.eos_token_id, tokenizer), config.stop,
                       tokenizer if wants_text else None) for ids in prompt_ids]
    if config.stop and not wants_text:
        raise ValueError("stop strings need a tokenizer: pass tokenizer=...")
    stats = GenerationStats(prompt_tokens=sum(map(len, prompt_ids)))
    t_start = time.perf_counter()

    active = [i for i, s in enumerate(states) if not s.finished]
    if not active:
        return _finish(states, stats, streamer)
    sequences = [list(ids) for ids in prompt_ids]
    starts = [0] * len(prompt_ids)
    max_len = min(block, max(len(prompt_ids[r]) for r in active) + config.max_new_tokens)
    kv = make_cache(cache, model, len(active), max_len)
    batch = _Batch(model, active, sequences, starts, kv)
    uses_penalties = config.repetition_penalty != 1 or config.presence_penalty != 0 or config.frequency_penalty != 0
    history = TokenHistory.from_prompts([prompt_ids[r] for r in active], model.config.vocab_size,
                                        model.device) if uses_penalties else None
    generators = row_generators(config, len(active))

    logits = batch.prefill()  # [B, V]
    stats.forward_passes += 1
    first_step = True
    while True:
        next_tokens = choose_next(process_logits(logits, config, history), config, generators)  # [B]
        if history is not None:
            history.add(next_tokens)
        for r, token in zip(batch.rows, next_tokens.tolist()):
            states[r].push(token)
            sequences[r].append(token)
            if streamer is not None and (piece := states[r].new_text()):
                streamer.put(r, piece)
        now = time.perf_counter()
        if first_step:
            stats.prefill_seconds, t_first, first_step = now - t_start, now, False
        keep = [i for i, r in enumerate(batch.rows) if not states[r].finished]
        if not keep:
            break
        if len(keep) < len(batch.rows):
            index = batch.keep(keep)
            next_tokens = next_tokens[index]
            history = history.select(index) if history is not None else None
            generators = [generators[i] for i in keep] if generators is not None else None

        slid = False
        for r in batch.rows:
            new_start = sliding_window_start(len(sequences[r]), starts[r], block, window_slide)
            slid |= new_start != starts[r]
            starts[r] = new_start
        logits = batch.prefill() if (slid or kv is None) else batch.step(next_tokens)
        stats.forward_passes += 1

    stats.decode_seconds = time.perf_counter() - t_first
    stats.decode_tokens = sum(len(s.token_ids) for s in states) - len(active)
    return _finish(states, stats, streamer)


def _finish(states, stats, streamer) -> GenerationOutput:
    if streamer is not None:
        for r, s in enumerate(states):
            if piece := s.new_text():
                streamer.put(r, piece)
        streamer.end()
    rows = [RowOutput(s.prompt_ids, s.token_ids, s.text, s.finish_reason) for s in states]
    return GenerationOutput(rows, stats)


if __name__ == "__main__":
    import sys

    from .cli import main

    sys.exit(main())
