"""minillm: LLM inference from scratch, one lesson at a time.

The package is layered; a module imports only from its own layer or below:

    front ends   cli, __main__, streaming, serve (HTTP), openai_api, async_engine, loadtest, bench, benchmarks/,
                 report
    strategies   infer (generate), speculative, lookahead, beam, scheduler, engine (continuous batching)
    session      session (DecodeSession), generation (events, outputs, prompts), batching
    decoding     settings, sampling, stopping, detokenize
    model        model, families, attention, attention_kernels, attention_triton, kv_cache, paged, onednn,
                 loading, tiny, precision
    weights      fetch, tokenizer, jsonio

(`tests/test_engine.py` checks the direction, the absence of cycles and of private
cross-module imports.)
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

from .loading import ModelLoadError, load_model  # noqa: E402  (after the handler: these imports take a while)
from .model import ModelConfig, Transformer  # noqa: E402

__all__ = ["load_model", "ModelLoadError", "ModelConfig", "Transformer"]
