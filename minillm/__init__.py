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

from .model.config import ModelConfig  # noqa: E402
from .model.fetch import ModelLoadError  # noqa: E402  (after the handler: these imports take a while)
from .model.transformer import Transformer
from .speed.load import load_model  # noqa: E402
from .strategies.generate import generate  # noqa: E402

__all__ = ["load_model", "generate", "ModelLoadError", "ModelConfig", "Transformer"]
