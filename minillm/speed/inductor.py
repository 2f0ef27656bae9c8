"""Inductor's settings for the course's compiles: frozen weights, a C++ driver, autotuning where it pays.

`CompiledModel` (compile.py) compiles in this process and `graph_store` builds kept packages; both
compile under `inductor_settings`, and both key what they build by whether it was autotuned.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from unittest import mock

import torch

from .onednn import libraries_stream_matvecs
from .quant import QuantizedLinear

AUTOTUNE_MIN_ELEMENTS = 1_000_000


def worth_autotuning(model, rows: int | None = 1) -> bool:
    """Whether autotuning pays for a step of this model on this machine whose matmuls multiply `rows` rows
    (1: a batch-1 decode step; None: any number, decided at each call, as the server's step).

    Autotuning generates, compiles and times a kernel for every matmul (`inductor_settings`). What
    it buys depends on the kernels it competes with, and what it costs is build time. Measured on
    the default model's decode graph, batch 1, two cores:

        quantized linears (any CPU)     Inductor's weight-only int8 and int4 kernels against ATen's:
                                        on a Xeon (AVX-512) int8 120.6 vs 67.1 tok/s, gguf (int4)
                                        138.7 vs 107.4, for builds of 52 s and 49 s instead of 38 s
        float, 2-core AMD EPYC (AVX2)   30 up-projections [3072, 576]: MKL 33%, oneDNN 54%, the generated
                                        kernel 85% of the read bandwidth (lesson 15's notebook), 1.6x
                                        oneDNN's speed; the FP32 build takes 175 s
        float, 2-core Xeon (AVX-512)    one row: MKL 85%, oneDNN 76%, the frozen graph's library calls
                                        97%, autotuned 90%: 43.6 vs 41.5 tok/s (+5%) for a build of 92 s
                                        instead of 40 s. Several rows: the graph's library call (MKL,
                                        the weight not prepacked) takes 8.0 ms for those 30 matmuls at
                                        one row, 15.6 at 4 and 20.7 at 8 (oneDNN prepacked: 11.7-13.2);
                                        the server's step over 8 rows 62 ms plain, 54 autotuned

    So a quantized model is always autotuned; a float one is, unless the step multiplies one row and
    Intel's libraries already stream matvecs (`libraries_stream_matvecs`). A model of a few thousand
    weights (the course's tiny test models) runs no faster with a tuned kernel and would triple its
    compile time.
    """
    if model.device.type != "cpu":
        # On a GPU a decode step's matmuls are already cuBLAS kernels streaming near the bandwidth; what
        # compiling buys there is one CUDA graph launch instead of hundreds of kernel launches.
        return False
    if sum(tensor.numel() for tensor in itertools.chain(model.parameters(), model.buffers())) < AUTOTUNE_MIN_ELEMENTS:
        return False
    quantized = any(isinstance(module, QuantizedLinear) for module in model.modules())
    return quantized or rows != 1 or not libraries_stream_matvecs()


@contextlib.contextmanager
def inductor_settings(autotune: bool, device):
    """Inductor's settings for a compile: frozen weights and, with `autotune`, generated matmul kernels.

    Freezing turns the weights into constants, so Inductor may lay them out for its own
    kernels once, at compile time. With autotune (`max_autotune`) each matmul becomes a
    choice: the library call (MKL on x86 CPUs) or a kernel Inductor generates for this
    exact shape (on CPUs its C++ GEMM template over the prepacked weight; on GPUs Triton
    templates), timed on the spot, the fastest kept. At batch 1 a decode matmul is a
    matrix-vector product whose speed is how fast the weight streams from memory, and a
    kernel made for one shape (no blocking for rows that never come) streams it closer
    to the memory bandwidth than a general GEMM library: that is most of the compiled
    step's gain. Autotuning costs compile time, once per graph; Inductor's own table of
    the timings is not printed.
    """
    from torch._inductor import config, select_algorithm

    on_cpu = torch.device(device).type == "cpu"
    settings = {"freezing": True}
    if on_cpu:
        # The graph's own driver in C++ rather than Python: a decode step launches some ten kernels per
        # block, and calling each from Python costs more than the small ones take to run.
        settings["cpp_wrapper"] = True
    # (On a GPU the same problem is solved by recording the step's launches once as a CUDA graph and
    # replaying it: `minillm.speed.cuda_graph`.)
    if autotune:
        settings.update(max_autotune=True, max_autotune_report_choices_stats=False)
        if on_cpu:
            settings["max_autotune_gemm_backends"] = "CPP,ATEN"
    quiet = contextlib.nullcontext()
    if autotune and hasattr(select_algorithm, "PRINT_AUTOTUNE"):
        quiet = mock.patch.object(select_algorithm, "PRINT_AUTOTUNE", False)
    with config.patch(settings), quiet, templates_compiled_once(), warnings.catch_warnings():
        # torch's own deprecation notes, not the reader's concern: Inductor's autotuner still calls `Tensor.storage()`,
        # and AOTInductor pickles a package's input spec through a check torch 2.13 deprecated.
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        yield


def templates_compiled_once():
    """While compiling, Inductor's kernel templates are parsed once per process instead of at every use.

    Inductor writes each C++ matmul kernel (and each timed candidate) by rendering Jinja
    templates: fixed strings, but parsed afresh at every render. The default model's decode
    graph renders them some 1,800 times, and parsing took 45 s of a 4-minute build on two
    cores (profiled with cProfile). A parsed template renders the same text every time, so
    it is kept, keyed by its source, while the compile runs. Without Inductor's template
    class (another torch) nothing is patched.
    """
    try:
        from torch._inductor.codegen.common import KernelTemplate
    except ImportError:
        return contextlib.nullcontext()
    parse = getattr(KernelTemplate, "_template_from_string", None)
    if parse is None:
        return contextlib.nullcontext()
    return mock.patch.object(KernelTemplate, "_template_from_string", staticmethod(_parsed_once(parse)))


@functools.cache
def _parsed_once(parse):
    """Inductor's parse function with its results kept for the process (one cache, however many compiles)."""
    return functools.cache(parse)


__all__ = ["AUTOTUNE_MIN_ELEMENTS", "inductor_settings", "libraries_stream_matvecs", "templates_compiled_once",
           "worth_autotuning"]
