"""minillm: LLM inference from scratch, one lesson at a time.

The package is the course's map: one subpackage per part, lowest first. A module imports
only from its own part or the parts below it (`tests/test_engine.py` checks the direction,
the absence of cycles and of private cross-module imports):

    infer, serve, export, bench/   front ends: `python -m minillm.infer|serve|export|bench`
    serving/      the OpenAI-compatible HTTP server and its load test (lesson 13)
    strategies/   decoding loops: generate, speculative, lookahead, beam, streaming (02, 03, 07-11)
    runtime/      a request's life: the decode session, batching, the scheduler, the engine (06, 07, 12)
    decoding/     choosing tokens and stopping: settings, logits processors, stop strings, text (02-04, 09)
    parallel/     tensor parallelism: one rank's shard of a model, the process group (20)
    speed/        precision, quantization, MX, attention kernels, compilation, ONNX export (05, 14-16)
    cache/        KV caches: contiguous (06) and paged, with prefix caching (12)
    model/        the transformer, its families, tokenizers and weights (01, 17)
    base/         what every part stands on: atomic JSON, one-line command errors
"""

import gc
import os
import signal
import sys

if sys.argv[:1] == ["-m"]:  # started as `python -m minillm...`: a Ctrl-C while importing exits with one line

    def _interrupted_while_starting(signum, frame):
        # Exit at once, without unwinding: a Ctrl-C can land inside torch's C++ start-up, and
        # running the interpreter's shutdown over half-built extension state can abort (a core
        # dump instead of one line). Nothing has been written yet that would need cleaning up.
        print("\nminillm: interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, _interrupted_while_starting)

# Importing torch leaves some 260,000 objects that live as long as the process, and the garbage collector's full
# passes over them while the rest imports cost about 0.15 s of a 1 s start (measured on the 2-core AMD EPYC). So
# collection waits while the package imports, and what the imports made is then frozen: moved out of the
# collector's view for good, as CPython's `gc.freeze` is meant for (later passes walk only what the run makes).
_collecting = gc.isenabled()
gc.disable()
try:
    from .model.config import ModelConfig  # noqa: E402
    from .model.fetch import ModelLoadError  # noqa: E402  (after the handler: these imports take a while)
    from .model.transformer import Transformer  # noqa: E402
    from .speed.load import load_model  # noqa: E402
    from .strategies.generate import generate  # noqa: E402
finally:
    gc.freeze()
    if _collecting:
        gc.enable()

__all__ = ["load_model", "generate", "ModelLoadError", "ModelConfig", "Transformer"]
