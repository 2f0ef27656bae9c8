"""llama.cpp as a contender: the same weights in the GGUF type a suite compares against.

llama.cpp is the C++ engine the course measures itself against. It is optional:
`pip install llama-cpp-python` builds it from source (a few minutes, needs cmake and
a C++ compiler), so the suites include it when it imports and say why not otherwise.
On a CPU with AMX (a Xeon of the Sapphire Rapids generation or later) the native build
crashes in its AMX matmul on quantized files, even with `use_extra_bufts=False`. Built
for AVX-512 without AMX it runs (the same vector code for batch-1 decode):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON" pip install --no-cache-dir llama-cpp-python

The default model ships as one Q4_1 GGUF. A fair FP32 comparison needs llama.cpp on
the *same* weights at full precision, and the int8 one on llama.cpp's own 8-bit
format, so `gguf_as` writes copies of the file with every quantized tensor
dequantized (F32) or requantized (Q8_0) by the `gguf` package: the weights minillm
runs in FP32 are exactly the F32 copy's. Copies are made once and kept in the cache,
written under a temporary name and renamed, so an interrupted conversion leaves
nothing half-written behind.

Its OpenAI-compatible server (`server_process`, llama-cpp-python's `llama_cpp.server`)
is the other engine the serving suite `serve-vs-llamacpp` loads like minillm's.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

from ..base.files import minillm_home, remove, temporary_path
from ..base.ports import free_port
from .server import ServerProcess

FILE_TYPES = {"F32": 0, "Q8_0": 7, "BF16": 32}  # general.file_type: LLAMA_FTYPE_ALL_F32, _MOSTLY_Q8_0, _MOSTLY_BF16
LLAMA_FILE_TYPES = {"Q4_K_M": 15}  # what llama.cpp's quantizer makes: its LLAMA_FTYPE_MOSTLY_Q4_K_M
# What llama-cpp-python's [server] extra adds, at versions that run beside requirements.txt's fastapi and uvicorn
SERVER_EXTRAS = "sse-starlette==3.7.0 starlette-context==0.3.6 pydantic-settings==2.16.3"


def missing_reason() -> str | None:
    """None when llama-cpp-python imports; otherwise what to install."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (pip install llama-cpp-python builds it; the suite then includes it)"
    return None


def server_missing_reason() -> str | None:
    """None when llama-cpp-python's OpenAI-compatible server imports; otherwise why not and what to install.

    Its server needs the packages of the `[server]` extra, which `pip install
    'llama-cpp-python[server]'` would fetch only by building llama.cpp again: installing
    them alone (`SERVER_EXTRAS`) is enough.
    """
    reason = missing_reason()
    if reason is not None:
        return reason
    try:
        importlib.import_module("llama_cpp.server.app")
    except ImportError as error:
        return (f"llama-cpp-python is installed but its server does not import ({error}): pip install "
                f"{SERVER_EXTRAS}, the packages its [server] extra lists")
    return None


def server_process(gguf: Path, threads: int, context: int = 2048) -> ServerProcess:
    """llama-cpp-python's OpenAI-compatible server on `gguf`, as a `ServerProcess` answering to the model name
    'default' (as minillm's does).

    Its defaults would skew a comparison: it would use half the cores, and with
    `interrupt_requests` on, a request arriving while another streams cuts that stream
    short. Off, requests wait their turn: this server runs one at a time.
    """
    port = free_port()
    return ServerProcess([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "default",
                          "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(context),
                          "--n_threads", str(threads), "--n_threads_batch", str(threads),
                          "--interrupt_requests", "False"], port)


def quantized_by_llama_cpp(source: Path, file_type: str = "Q4_K_M") -> Path:
    """`source` requantized by llama.cpp's own quantizer (`llama_model_quantize`, from its F32 copy), converted once
    and cached: a file as llama.cpp users make and download them, mixing block types (a Q4_K_M of the default model
    keeps Q4_K only where a row is a multiple of 256, and falls back to Q5_0, Q6_K and Q8_0 elsewhere)."""
    import ctypes

    import llama_cpp

    target = minillm_home() / "llama.cpp" / f"{source.stem}.{file_type}.gguf"
    if target.is_file() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FILE_TYPES[file_type]
    partial = temporary_path(target)
    try:
        if llama_cpp.llama_model_quantize(str(gguf_as(source, "F32")).encode(), str(partial).encode(),
                                          ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed to write {file_type} from {source.name}")
        partial.replace(target)
    finally:
        remove(partial)
    return target


def gguf_as(source: Path, tensor_type: str) -> Path:
    """`source` with its quantized weights stored as `tensor_type` ("F32", "Q8_0" or "BF16"), converted once and
    cached."""
    import gguf
    from tqdm import tqdm

    if tensor_type not in FILE_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r}: choose one of {', '.join(FILE_TYPES)}")
    target = minillm_home() / "llama.cpp" / f"{source.stem}.{tensor_type}.gguf"
    if target.is_file() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wanted = gguf.GGMLQuantizationType[tensor_type]
    reader = gguf.GGUFReader(source)
    partial = temporary_path(target)
    try:
        writer = gguf.GGUFWriter(partial, str(reader.fields["general.architecture"].contents()))
        for field in reader.fields.values():  # the metadata as it is, but for the file type
            if field.name == "general.architecture" or field.name.startswith("GGUF."):
                continue
            value = FILE_TYPES[tensor_type] if field.name == "general.file_type" else field.contents()
            kind = field.types[0]
            writer.add_key_value(field.name, value, kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        for tensor in tqdm(reader.tensors, desc=f"GGUF as {tensor_type}", unit="tensor"):
            data, stored = np.asarray(tensor.data), tensor.tensor_type
            if stored not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):  # leave norms as they are
                data = gguf.quants.dequantize(data, stored)  # float32 [rows, columns]
                if wanted != gguf.GGMLQuantizationType.F32:
                    data = gguf.quants.quantize(data, wanted)
                stored = wanted
            writer.add_tensor(tensor.name, data, raw_dtype=stored)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.replace(target)
    finally:
        remove(partial)
    return target


class LlamaCpp:
    """llama.cpp on one GGUF, timed as the other contenders are: greedy decode and prefill."""

    def __init__(self, gguf_path: Path, context: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf_path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                         verbose=False, use_extra_bufts=False)  # its repacked-weight path has crashed on some x86 CPUs

    def decode(self, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """(seconds for the new_tokens - 1 steps after the first token, the new token ids), prefill excluded:
        the same count minillm's and transformers' decode clocks time."""
        self.llm.reset()
        self.llm.eval(prompt)
        tokens = [self.llm.sample(temp=0)]
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval(tokens[-1:])
            tokens.append(self.llm.sample(temp=0))
        return time.perf_counter() - start, tokens

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to run the prompt through the model (its logits for the first token)."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - start


__all__ = ["LlamaCpp", "gguf_as", "missing_reason", "server_missing_reason", "server_process"]
