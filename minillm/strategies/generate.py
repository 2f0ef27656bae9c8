"""The generation loop: prefill once, then one token per step, until every row stops.

    from minillm import load_model
    from minillm.strategies.generate import generate
    model, tok = load_model("default")
    out = generate(model, ["The capital of France is"], tokenizer=tok, max_new_tokens=20)
    out.rows[0].text, out.rows[0].finish_reason, out.stats.decode_tokens_per_second

    for event in generate(model, prompts, tokenizer=tok, stream=True):   # the same run, as it happens
        print(event.row, event.text, end="")

The loop is a few lines over a `ModelRunner` (`minillm.runtime.runner`), which owns the KV
cache, the rows, positions and masks, and how the model runs (eager or compiled graphs).
Each prompt is a `Sequence` (`minillm.runtime.sequence`) carrying its own settings, random
stream and stop state: this module only asks the runner for logits, draws each sequence's
next token and lets finished ones leave. Pass a list of configs for one per row: a server
batches requests that way.

The context window. A model only knows `context_length` positions. When a row outgrows
it, its window (the tokens the model sees) moves forward by `window_slide` tokens
and the batch is prefilled again from the new windows. The rule is the same with
and without a cache, so all cache kinds give the same tokens; sliding by more than
one token at a time means fewer re-prefills for a little less context.

Run as `python -m minillm.infer --prompt "..."` for the command-line interface.
"""

from __future__ import annotations

import time

import torch

from ..decoding.outputs import GenerationOutput, GenerationStats, check_prompts, drain, encode_prompts
from ..decoding.sampling import SamplingConfig, row_configs
from ..runtime.batching import length_sorted_chunks
from ..runtime.runner import ModelRunner
from ..runtime.sequence import Sequence, sample_next


def sliding_window_start(length: int, start: int, context_length: int, slide: int) -> int:
    """Where a row's window begins once it holds `length` tokens: unchanged while it fits,
    else moved forward by `slide` (at least far enough to fit)."""
    if length - start <= context_length:
        return start
    return max(start + slide, length - context_length)


class Generation:
    """One `generate` call: iterate it for events; `output` holds the result once it is done.

    Everything is checked when it is created, so a bad setting fails at the call, before
    any model work.
    """

    def __init__(self, model, prompts, config=None, *, tokenizer=None, cache: str = "static",
                 window_slide: int = 1, compile: bool | None = None, **config_overrides):
        if not 1 <= window_slide <= model.config.context_length:  # a longer slide would leave the window empty
            raise ValueError(f"window_slide={window_slide} is invalid: must be between 1 and the model's context "
                             f"length ({model.config.context_length})")
        self.model, self.tokenizer, self.window_slide = model, tokenizer, window_slide
        prompt_ids = encode_prompts(prompts, tokenizer)
        check_prompts(prompt_ids, model.config.context_length, model.config.vocab_size)
        configs = row_configs(config, len(prompt_ids), config_overrides)
        if any(c.stop for c in configs) and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer=...")
        longest = max(len(p) + c.max_new_tokens for p, c in zip(prompt_ids, configs))
        # Compiled, making the runner loads (or builds, once) the decode graph: its own phase, before the
        # clock of the first token starts.
        graph = {None: "auto", True: "compiled", False: "eager"}[compile]
        self.runner = ModelRunner(model, cache=cache, graph=graph, max_len=longest,
                                  max_batch=len(prompt_ids))
        self.seqs = [Sequence.create(ids, c, tokenizer=tokenizer, vocab_size=model.config.vocab_size,
                                     device=model.device, id=row) for row, (ids, c) in enumerate(zip(prompt_ids, configs))]
        self.stats = GenerationStats(prompt_tokens=sum(map(len, prompt_ids)), build_seconds=self.runner.build_seconds,
                                     extra=self.runner.graph_stats())
        self.output: GenerationOutput | None = None
        self.started = False

    @torch.inference_mode()
    def __iter__(self):
        if self.started:
            raise RuntimeError("a Generation runs once: call generate() again for another run")
        self.started = True
        runner, context = self.runner, self.model.config.context_length
        t_start = time.perf_counter()
        for seq in self.seqs:
            if seq.finished:  # max_new_tokens == 0
                yield seq.event([])
        active = [s for s in self.seqs if not s.finished]
        logits = runner.prefill(active) if active else None  # [B, V]
        t_first = None
        while active:
            self.stats.forward_passes += 1
            for seq, token in zip(active, sample_next(active, logits)):
                seq.append(token)
            if t_first is None:
                t_first = time.perf_counter()
                self.stats.prefill_seconds = t_first - t_start
            yield from [seq.event([seq.tokens[-1]]) for seq in active]
            active = [s for s in active if not s.finished]  # finished rows leave the batch
            if not active:
                break
            slid = False
            for seq in active:
                start = sliding_window_start(len(seq.tokens), seq.window_start, context, self.window_slide)
                slid |= start != seq.window_start
                seq.window_start = start
            # A row that outgrew the context restarts every row from its window; else one token each.
            logits = runner.prefill(active) if slid else runner.decode(active)
        if t_first is not None:
            self.stats.decode_seconds = time.perf_counter() - t_first
        self.stats.decode_tokens = sum(max(len(s.generated) - 1, 0) for s in self.seqs)
        self.output = GenerationOutput([s.output() for s in self.seqs], self.stats)


def generate(model, prompts, config: SamplingConfig | list[SamplingConfig] | None = None, *, tokenizer=None,
             cache: str = "static", streamer=None, window_slide: int = 1, stream: bool = False,
             compile: bool | None = None, **config_overrides):
    """Generate a continuation for each prompt.

    prompts: a string, a list (or 1-D tensor) of token ids, or a list of either (a batch).
    config: how to choose tokens and when to stop; one for every row, or a list with one
        per row. Keyword arguments override its fields
        (`generate(..., max_new_tokens=20, do_sample=True, seed=0)`).
    tokenizer: needed for text prompts, text output, stop strings and streaming.
    cache: "static" (default), "dynamic", or "none" (recompute everything each step).
    streamer: an object with `put(row, text)` and `end()` that receives final text as it forms.
    window_slide: how far the context window moves when a row outgrows `context_length`.
    stream: return the `Generation` to iterate over its events instead of running it.
    compile: True decodes through a compiled graph over a fixed-shape static cache (lesson 15,
        `minillm.speed.compile`) kept on disk: the first call on a machine builds it (a minute or
        more), later calls and processes load it in seconds (`stats.build_seconds`). None (the
        default) uses that graph when it is already built, else runs eagerly; False: always eager.

    Returns a GenerationOutput (or, with stream=True, the Generation).
    """
    run = Generation(model, prompts, config, tokenizer=tokenizer, cache=cache, window_slide=window_slide,
                     compile=compile, **config_overrides)
    if stream:
        return run
    return drain(run, streamer)


def generate_in_batches(model, prompts, batch_size: int, config=None, *, tokenizer=None, streamer=None,
                        **generate_kwargs) -> GenerationOutput:
    """`generate()` over many prompts, at most `batch_size` at a time.

    Prompts are grouped by length (`minillm.runtime.batching.length_sorted_chunks`); rows come
    back in input order and the statistics are summed over the chunks. Each row's tokens
    are the ones `generate()` gives it alone, so the split changes speed, never output.
    """
    rows = encode_prompts(prompts, tokenizer)
    check_prompts(rows, model.config.context_length, model.config.vocab_size)  # name the bad row by its input index
    configs = row_configs(config, len(rows), {})
    outputs, stats = [None] * len(rows), GenerationStats()
    for index in length_sorted_chunks([len(r) for r in rows], batch_size):
        run = generate(model, [rows[i] for i in index], [configs[i] for i in index], tokenizer=tokenizer,
                       stream=True, **generate_kwargs)
        for event in run:
            if streamer is not None and event.text:
                streamer.put(index[event.row], event.text)
        for i, row in zip(index, run.output.rows):
            outputs[i] = row
        stats.add(run.output.stats)
    if streamer is not None:
        streamer.end()
    return GenerationOutput(outputs, stats)

