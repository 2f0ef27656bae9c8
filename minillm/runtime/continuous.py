"""`generate_continuous`: `generate`'s call and output, with every prompt run through one continuous-batching `Engine`.

What a test or a lesson uses to set the engine beside `generate`: the same rows back, in
input order, whatever the arrival order replayed (lesson 12).
"""

from __future__ import annotations

import time

from ..decoding.outputs import GenerationOutput, GenerationStats, encode_prompts
from ..decoding.sampling import row_configs
from .engine import Engine


def generate_continuous(model, prompts, config=None, *, tokenizer=None, arrivals: list[int] | None = None,
                        engine_options: dict | None = None, streamer=None, **config_overrides) -> GenerationOutput:
    """Run every prompt through one `Engine` and return the rows in input order (`generate`'s output).

    arrivals: the step at which each prompt is added (default: all at step 0), so a test or
    a lesson can replay any arrival order; config: one for every prompt or one per prompt.
    """
    rows = encode_prompts(prompts, tokenizer)
    configs = row_configs(config, len(rows), config_overrides)
    arrivals = [0] * len(rows) if arrivals is None else list(arrivals)
    if len(arrivals) != len(rows) or min(arrivals, default=0) < 0:
        raise ValueError(f"arrivals: give one step number >= 0 per prompt ({len(rows)} prompts), got {arrivals}")
    engine = Engine(model, tokenizer, **(engine_options or {}))
    ids: dict[int, int] = {}  # request id -> prompt index
    order = sorted(range(len(rows)), key=lambda i: arrivals[i])
    step, start = 0, time.perf_counter()
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            ids[engine.add_request(rows[i], configs[i])] = i
        for event in engine.step():
            if streamer is not None and event.text:
                streamer.put(ids[event.row], event.text)
        step += 1
    if streamer is not None:
        streamer.end()
    outputs = [None] * len(rows)
    for request_id, i in ids.items():
        outputs[i] = engine.output(request_id)
    stats = GenerationStats(prompt_tokens=sum(map(len, rows)), forward_passes=engine.forward_passes,
                            decode_tokens=sum(max(len(o.token_ids) - 1, 0) for o in outputs),
                            decode_seconds=time.perf_counter() - start)
    stats.extra.update(prefix_hit_rate=engine.prefix_hit_rate,
                       preemptions=sum(r.preemptions for r in engine.requests.values()),
                       graph=engine.runner.graph, compiled_steps=engine.runner.compiled_steps)
    stats.build_seconds = engine.runner.build_seconds
    return GenerationOutput(outputs, stats)


__all__ = ["generate_continuous"]
