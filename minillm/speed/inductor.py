"""Inductor's settings for the course's compiles: frozen weights, a C++ driver, and which kernels run the matmuls.

`CompiledModel` (compile.py) compiles in this process and `graph_store` builds kept packages; both
compile under `inductor_settings`, and both key what they build by its matmul kernels (`MATMUL_KERNELS`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import warnings
from unittest import mock

import torch

from .onednn import onednn_packs_float32
from .quant import Int4WeightLinear, QuantizedLinear

GENERATED_MIN_ELEMENTS = 1_000_000  # weights and buffers: a smaller model keeps the library's (`matmul_kernels`)
# What runs a compiled step's weight matmuls: the library's call (MKL or oneDNN on a CPU, cuBLAS on a GPU),
# a kernel Inductor generates for each weight's exact shape, both, timed on the spot and the faster kept, or
# oneDNN's product on a weight it packed once (`minillm.speed.onednn.onednn_linear`, float32 on a CPU).
MATMUL_KERNELS = ("library", "generated", "timed", "onednn")


def matmul_kernels(model, rows: int | None = 1) -> str:
    """Which kernels run the matmuls of a compiled step of this model whose matmuls multiply `rows` rows
    (1: a batch-1 decode step, matrix-vector products; None: any number, decided at each call, as the
    server's step); one of `MATMUL_KERNELS`.

    Generating a kernel costs build time (writing and compiling its C++); timing it against the
    library's costs more (every candidate compiled and run). Measured on the default model, two cores:

        one row, float32, 2-core Xeon   the whole decode step with generated matvecs 20.9 ms against
        (AVX-512)                       23.4 with MKL's, built in 50 s against 39 s (two packages
                                        loaded in one process, calls alternated; lesson 15's notebook
                                        times the same); timing both, in an earlier session, built in
                                        92 s and bought 5%. The generated kernels read their own
                                        re-laid-out copy of the weights (542 MB), which a load places
                                        in huge pages (about a second on the course's VM); the command
                                        line then skips placing the model's copy (`defer_placement`),
                                        and a whole 128-token CLI run took 5.6-6.2 s against 5.8-6.8
                                        with MKL's matvecs (alternated; 6.6-7.2 without skipping)
        one row, float32, 2-core AMD    30 up-projections [3072, 576]: MKL 33%, oneDNN 54%, the generated
        EPYC (AVX2)                     kernel 85% of the read bandwidth (lesson 15's notebook, earlier
                                        sessions): timing always picked the generated kernel
        one row, quantized (any CPU)    Inductor's weight-only int8 and int4 kernels: int8 120.6 tok/s
                                        against ATen's 67.1, int4 138.7 against 107.4 on the Xeon; timing
                                        keeps the same kernels (the same logits, bit for bit) and builds
                                        the int8 and int4 steps in 53 and 50 s against 50 and 48 generated
        several rows (float)            MKL, handed a weight it has not prepacked, takes 8.0 ms for the 30
                                        up-projections at one row, 15.6 at 4 and 20.7 at 8 (oneDNN
                                        prepacked: 11.7-13.2); the server's step over 8 rows 62 ms plain,
                                        54 timed: there the library's call and the generated kernel
                                        trade places by shape, so both are timed

        several rows, float32,          verify steps, timed (the generated kernels won): 4 tokens 20.9 ms, 8
        2-core AMD EPYC (AVX-512)       26.0, 9 33 (8 rows and then the ninth alone), 16 44.6; a decode step
                                        13.5. A 9-token step with the library's call (MKL, its AVX2 kernels on
                                        an AMD CPU, on a weight it has not packed) 56 ms, with oneDNN's product
                                        on weights packed at the first call 24.5, the packing 0.19 s once. The
                                        30 layers' matmuls alone, 9 rows: MKL 36 ms, oneDNN packed 12.4.
                                        Since the generated kernels prefetch their weight rows
                                        (`weights_prefetched`): 8 tokens 23.3 ms against a decode step's 8.0
                                        at a 128-token cache, 26.5 against 8.8 at 448 (one run, not alternated)

        any number of rows, float32     the server's step (`PagedShape`): its rows are symbolic, so no kernel
                                        is written for them and timing has nothing to time; the library's
                                        call is MKL's on the weight as it lies, oneDNN's packed product a
                                        long-running server packs once

        one row, int4, AVX2 CPU         Inductor has no generated kernel for `_weight_int4pack_mm_for_cpu`
                                        without AVX-512 (its C++ template offers no choice, and the build
                                        stops with NoValidChoicesError: `--quant gguf` on the AMD EPYC), so
                                        there the library's call stays in the running, timed

    So one row gets generated kernels, a fixed number of rows timed ones, and any number of rows of a float32
    model oneDNN's packed product (`onednn`; of a quantized one, timed). A model of a few thousand weights
    (the course's tiny test models) runs no faster with either and would triple its compile time: it keeps
    the library's.

    On a GPU a batch-1 step of the default model is some 240 small kernels in series (2.0 ms a token on an
    H200 with cuBLAS's matrix-vector products, 7% of the bandwidth's bound: `results/cuda/decode.json`), so
    what counts there is how many kernels run, not how fast each streams. "generated" on a GPU writes each
    one-row matmul as an Inductor reduction (gpt-fast's setting, `inductor_settings`), which Inductor can fuse
    with the elementwise work on either side of it and, for int8 weights, with their widening: fewer
    kernels, and int8 read as one byte per weight. Not yet timed against cuBLAS's: the decode suite on a GPU
    runs both ("minillm captured" and "minillm captured, library matmuls"). More rows keep cuBLAS's.
    """
    if sum(tensor.numel() for tensor in itertools.chain(model.parameters(), model.buffers())) < GENERATED_MIN_ELEMENTS:
        return "library"
    if model.device.type != "cpu":
        return "generated" if rows == 1 else "library"
    if rows == 1 and not (holds_int4_weights(model) and "AVX512" not in torch.backends.cpu.get_cpu_capability()):
        return "generated"
    if rows is None and onednn_packs_float32(model) and not holds_quantized_weights(model):
        return "onednn"
    return "timed"


def holds_quantized_weights(model) -> bool:
    """Whether some matmul of the model multiplies quantized weights (lesson 14's modules)."""
    return any(isinstance(module, QuantizedLinear) for module in model.modules())


def holds_int4_weights(model) -> bool:
    """Whether a matmul of the model multiplies packed int4 weights (`_weight_int4pack_mm_for_cpu`)."""
    return any(isinstance(module, Int4WeightLinear) for module in model.modules())


def check_matmul_kernels(matmuls: str | None) -> None:
    if matmuls is not None and matmuls not in MATMUL_KERNELS:
        raise ValueError(f"matmuls={matmuls!r}: choose one of {', '.join(MATMUL_KERNELS)} (or None to decide per step)")


@contextlib.contextmanager
def inductor_settings(matmuls: str, device):
    """Inductor's settings for a compile: frozen weights and the matmul kernels `matmuls` names (`MATMUL_KERNELS`).

    Freezing turns the weights into constants, so Inductor may lay them out for its own
    kernels once, at compile time. "onednn" compiles as "library": its matmuls are already calls to
    `onednn_linear`, put there when the step is traced (`minillm.speed.onednn.linears_call_onednn`).
    "generated" and "timed" turn on `max_autotune`, which makes
    each matmul a choice among candidates: "generated" offers only the kernel Inductor writes
    for this exact shape (on CPUs its C++ GEMM template over the prepacked weight; on GPUs a
    Triton template), so nothing is timed; "timed" adds the library's call (MKL on x86 CPUs),
    runs each candidate on the spot and keeps the fastest. At batch 1 a decode matmul is a
    matrix-vector product whose speed is how fast the weight streams from memory, and a
    kernel made for one shape (no blocking for rows that never come) streams it at least as
    close to the bandwidth as a general GEMM library. A matmul the template cannot write keeps
    the library's call. Inductor's own table of the timings is not printed. On a GPU "generated" instead
    turns on `coordinate_descent_tuning`, under which Inductor decomposes a one-row matmul into a
    multiply and a sum (its reduction kernels, their block sizes tuned by coordinate descent), fusible
    with their neighbours (`matmul_kernels`).
    """
    from torch._inductor import config, select_algorithm

    check_matmul_kernels(matmuls)
    on_cpu = torch.device(device).type == "cpu"
    settings = {"freezing": True}
    if on_cpu:
        # The graph's own driver in C++ rather than Python: a decode step launches some ten kernels per
        # block, and calling each from Python costs more than the small ones take to run.
        settings["cpp_wrapper"] = True
    # (On a GPU the same problem is solved by recording the step's launches once as a CUDA graph and
    # replaying it: `minillm.speed.cuda_graph`.)
    if matmuls == "generated" and not on_cpu:
        settings["coordinate_descent_tuning"] = True
    elif matmuls in ("generated", "timed"):
        generated = "CPP" if on_cpu else "TRITON"
        settings.update(max_autotune=True, max_autotune_report_choices_stats=False, autotune_fallback_to_aten=True,
                        max_autotune_gemm_backends=generated if matmuls == "generated" else f"{generated},ATEN")
    quiet = contextlib.nullcontext()
    if matmuls in ("generated", "timed") and hasattr(select_algorithm, "PRINT_AUTOTUNE"):
        quiet = mock.patch.object(select_algorithm, "PRINT_AUTOTUNE", False)
    with (config.patch(settings), quiet, templates_compiled_once(), index_texts_parsed_once(), weights_prefetched(),
          warnings.catch_warnings()):
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
    return torch_patch("torch._inductor.codegen.common", "KernelTemplate", "_template_from_string",
                     lambda parse: staticmethod(_parsed_once(parse)))


@functools.cache
def _parsed_once(parse):
    """Inductor's parse function with its results kept for the process (one cache, however many compiles)."""
    return functools.cache(parse)


def index_texts_parsed_once():
    """While compiling, the C++ matmul template's index expressions are parsed once per process instead of at each use.

    The template names the offsets and sizes of its blocks as text ("m_start", "n_end - n_start")
    and Inductor turns each into a sympy expression with sympy's parser at every use: 11,100
    parses of 25 distinct texts for the default model's GGUF decode step, rendered twice per
    matmul (once to offer the kernel as a choice, once to write it). Kept, keyed by the text
    (sympy expressions are immutable, so one can be shared), the GGUF step built 3-8 s sooner in
    four alternated pairs on the course's Xeon (47.2 and 47.9 s against 55.0 and 54.0; in a slower
    hour 53.5 and 58.8 against 56.6 and 63.9), and the generated C++ is the same, byte for byte
    (the files, named by their content's hash, keep their names). Without the template's module
    (another torch) nothing is patched.
    """
    return torch_patch("torch._inductor.codegen.cpp_template_kernel", None, "parse_expr_with_index_symbols",
                     _index_parser)


# How far ahead of its reads the generated float matmul kernel asks for weight rows (`weights_prefetched`): 32 rows
# of a 48-float panel, 6 KB. The 8-token verify step took 25.5, 24.4 and 26.0 ms with 16, 32 and 64.
PREFETCH_ROWS = 32
WEIGHT_ROW_LOAD = """        {%- else %}
            vb[col] = Vectorized::loadu(B + k * ldb + col * VLEN);
        {%- endif %}"""


def weights_prefetched():
    """While compiling, Inductor's float matmul kernel asks for each weight row `PREFETCH_ROWS` rows before it reads it.

    The kernel multiplies a few rows of activations by a panel of the packed weight, one weight
    row (48 floats) per step. Over one row (a decode step's matrix-vector products) the loads
    keep the memory busy; over 8 (a verify step) each weight row feeds 24 multiply-adds and the
    next load waits for memory: perf put half of the verify step's samples on those loads, and
    the up-projections read their weights at 17 GB/s where the decode step reads at 40. A
    software prefetch (Inductor's int8 kernel has one; its float kernel has none) takes the
    8-token verify step from 36.3 to 24.4 ms and leaves the decode step as it was (12.9 against
    13.1 ms; both through kept packages on the 2-core AMD EPYC with AVX-512). The panels lie one
    after another, so near a panel's end it asks for the next one's start, and a prefetch of an
    address past the weight never faults. It changes no result. Where the kernel's text is not
    the one expected (another torch), nothing is patched.
    """
    return torch_patch("torch._inductor.codegen.cpp_micro_gemm", "CppMicroGemmFP32Vec", "TEMPLATE_KERNEL",
                       _prefetching)


def _prefetching(template: str) -> str:
    """Inductor's float micro-kernel text with a prefetch before each weight row's load (`weights_prefetched`)."""
    if template.count(WEIGHT_ROW_LOAD) != 1:
        return template
    ahead = f"B + (k + {PREFETCH_ROWS}) * ldb + col * VLEN"
    prefetch = f"            _mm_prefetch(reinterpret_cast<const char*>({ahead}), _MM_HINT_T0);\n"
    load = WEIGHT_ROW_LOAD.splitlines()
    return template.replace(WEIGHT_ROW_LOAD, "\n".join([load[0], prefetch + load[1], load[2]]))


def torch_patch(module: str, owner: str | None, name: str, replacement):
    """A context that sets `module.owner.name` (or `module.name`) to `replacement(what it was)`; where torch has no such
    thing, a context that changes nothing."""
    try:
        importlib.import_module("torch._inductor.select_algorithm")  # first: the template modules import it circularly
        target = importlib.import_module(module)
    except ImportError:
        return contextlib.nullcontext()
    target = getattr(target, owner, None) if owner else target
    original = getattr(target, name, None)
    if original is None:
        return contextlib.nullcontext()
    return mock.patch.object(target, name, replacement(original))


@functools.cache
def _index_parser(parse):
    """`parse` (text, a sympy expression, or a list of either -> sympy) with each text's result kept for the process."""
    import sympy

    parse_text = functools.cache(parse)

    def parse_kept(expression):
        if isinstance(expression, sympy.Expr):
            return expression
        if isinstance(expression, (list, tuple)):
            return [parse_kept(e) for e in expression]
        return parse_text(str(expression))

    return parse_kept


__all__ = ["GENERATED_MIN_ELEMENTS", "MATMUL_KERNELS", "check_matmul_kernels", "holds_quantized_weights",
           "index_texts_parsed_once", "inductor_settings", "matmul_kernels", "templates_compiled_once", "torch_patch",
           "weights_prefetched"]
