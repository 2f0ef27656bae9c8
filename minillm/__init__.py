"""minillm: LLM inference from scratch, one lesson at a time.

The package is layered; a module imports only from its own layer or below:

    front ends   cli, __main__, streaming, bench, benchmarks/, report
    strategies   infer (generate), speculative, lookahead, beam
    session      session (DecodeSession), generation (events, outputs, prompts), batching
    decoding     settings, sampling, stopping, detokenize
    model        model, attention, kv_cache, onednn, loading, tiny, precision
    weights      fetch, tokenizer, jsonio

(`tests/test_engine.py` checks the direction, the absence of cycles and of private
cross-module imports.)
"""

import signal
import sys

if sys.argv[:1] == ["-m"]:  # started as `python -m minillm...`: a Ctrl-C while importing exits with one line

    def _interrupted_while_starting(signum, frame):
        print("\nminillm: interrupted", file=sys.stderr)
        raise SystemExit(130)

    signal.signal(signal.SIGINT, _interrupted_while_starting)

from .loading import ModelLoadError, load_model  # noqa: E402  (after the handler: these imports take a while)
from .model import ModelConfig, Transformer  # noqa: E402

__all__ = ["load_model", "ModelLoadError", "ModelConfig", "Transformer"]
