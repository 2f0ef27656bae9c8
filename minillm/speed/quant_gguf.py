"""The GGUF's own 4-bit blocks, run natively by the int4 kernel (lesson 14).

llama.cpp stores a matrix row by row in blocks of 32 weights. The default model's
matrices are Q4_1 blocks of 20 bytes:

    bytes 0-1   d, float16        the block's step
    bytes 2-3   m, float16        the block's minimum
    bytes 4-19  16 bytes of nibbles: weight i in the low nibble of byte i, weight i + 16 in the high one
    weight = d·q + m,  q in 0..15

PyTorch's int4 CPU kernel computes w = (q − 8)·scale + zero per group of K. A Q4_1 block
is exactly a group of 32 with scale = d and zero = m + 8·d: the same q codes, no
rounding, and never a float32 copy of the matrix. Q4_0 (18 bytes: d, then nibbles;
w = d·(q − 8)) is a group with zero 0. Q8_0 (34 bytes: d, then 32 int8; w = d·q) has
no int4 form; the tied embedding / LM head is Q8_0 here, and `use_gguf_weights` turns it
into the int8 kernel's one scale per row, requantizing from the decoded blocks (chunk by
chunk): int8 per row costs about one more rounding than Q8_0's per-32 scales (measured
in the lesson), and keeps the head at one byte per weight instead of four.

A Q4_K_M file (`minillm.speed.kquants`) goes the same two ways: its Q4_K sub-blocks are
groups of 32 with scale d·scale_j and zero 8·d·scale_j − dmin·min_j, code for code on the
int4 kernel; its wider blocks (Q6_K, and the Q5_0 / Q5_1 llama.cpp falls back to where a
row is not a multiple of 256) have no 4-bit form and go to int8 rows like Q8_0. A fused
matrix whose parts are stored in different types (the default model's q/k/v in a Q4_K_M:
Q5_0 and Q8_0) goes to int8 rows whole, unless every part is 4-bit.

The block codecs here (`encode_blocks`, `decode_blocks`) are written out from the
format and checked bit-exact against the `gguf` package's own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..model.gguf import read_gguf, unpermute_rope
from ..model.loading import DEFAULT_ALIASES, GEMMA3_MODEL, default_gguf_path, gemma3_source, resolve_checkpoint_folder
from .kquants import KQUANT_BLOCK, decode_kquant, dequantize_kquant, float16
from .mx_experts import experts_in_mxfp4
from .quant import (Int4WeightLinear, Int8WeightLinear, QuantizationError, check_int4_dtype, check_int4_shape,
                    quantize_int4_groupwise)
from .quantize_model import quantize_model, replace_module

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
NATIVE_INT4 = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit codes with a scale and zero per 32 weights: the int4 kernel's own
INT8_ROWS = ("Q8_0", "Q5_0", "Q5_1", "Q6_K")  # wider codes: the int8 kernel, each row requantized from its blocks
# The GGUF architectures mapped here, and whether llama.cpp's converter permuted their q/k rows for its rotary kernel
# (llama: yes; gemma3: no, its rows keep Hugging Face's order).
ROPE_PERMUTED = {"llama": True, "gemma3": False}


# ------------------------------------------------------------------ block codecs


def split_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: byte i holds element i (low nibble) and element i + 16 (high)."""
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1)


def join_nibbles(codes: np.ndarray) -> np.ndarray:
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)


def decode_blocks(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw rows [N, K / 32 · bytes] -> (codes [N, K], d float32 [N, K / 32], m float32 [N, K / 32] or None).

    Q4_1: w = d·q + m (q uint8 0..15); Q4_0: w = d·(q − 8) (q uint8 0..15, m None);
    Q8_0: w = d·q (q int8, m None). Nothing is multiplied out: the codes stay codes.
    """
    if kind not in BLOCK_BYTES:
        raise QuantizationError(f"GGUF block type {kind} has no native path here: minillm runs "
                                f"{', '.join(BLOCK_BYTES)} blocks; use --quant int4 to requantize the weights")
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, BLOCK_BYTES[kind])  # [N, K / 32, bytes]
    d = float16(blocks[..., 0:2])
    if kind == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(n, -1), d, None
    if kind == "Q4_0":
        return split_nibbles(blocks[..., 2:]).reshape(n, -1), d, None
    m = float16(blocks[..., 2:4])
    return split_nibbles(blocks[..., 4:]).reshape(n, -1), d, m


def dequantize_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    """Raw rows -> float32 [N, K]: the plain reference the native paths are checked against."""
    q, d, m = decode_blocks(data, kind)
    n = q.shape[0]
    q = q.reshape(n, -1, BLOCK).astype(np.float32)
    w = d[..., None] * (q - 8 if kind == "Q4_0" else q) + (0 if m is None else m[..., None])
    return w.reshape(n, -1)


def encode_blocks(weight: np.ndarray, kind: str) -> np.ndarray:
    """float32 [N, K] -> raw rows, rounding as llama.cpp's reference quantizer does.

    Q8_0: d = max|w| / 127, q = round(w / d) (half away from zero). Q4_1: d = (max − min) / 15,
    q = trunc((w − min) / d + 0.5). Q4_0: d = (the value of largest magnitude) / −8,
    q = trunc(w / d + 8.5) clipped to 15. Each d (and m) is stored as float16.
    """
    if kind not in BLOCK_BYTES:
        raise QuantizationError(f"cannot encode {kind}: use one of {', '.join(BLOCK_BYTES)}")
    n = weight.shape[0]
    w = weight.astype(np.float32).reshape(n, -1, BLOCK)
    with np.errstate(divide="ignore"):
        if kind == "Q8_0":
            d = np.abs(w).max(axis=-1, keepdims=True) / 127
            inverse = np.where(d == 0, 0, 1 / d)
            scaled = w * inverse
            q = (np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)).astype(np.int8).view(np.uint8)
            body = [d.astype(np.float16).view(np.uint8), q]
        elif kind == "Q4_0":
            peak = np.take_along_axis(w, np.abs(w).argmax(axis=-1)[..., None], axis=-1)
            d = peak / -8
            inverse = np.where(d == 0, 0, 1 / d)
            q = np.trunc(w * inverse + np.float32(8.5)).astype(np.uint8).clip(0, 15)
            body = [d.astype(np.float16).view(np.uint8), join_nibbles(q)]
        else:
            low, high = w.min(axis=-1, keepdims=True), w.max(axis=-1, keepdims=True)
            d = (high - low) / 15
            inverse = np.where(d == 0, 0, 1 / d)
            q = np.trunc((w - low) * inverse + np.float32(0.5)).astype(np.uint8).clip(0, 15)
            body = [d.astype(np.float16).view(np.uint8), low.astype(np.float16).view(np.uint8), join_nibbles(q)]
    return np.concatenate(body, axis=-1).reshape(n, -1)


# ------------------------------------------------------------------ GGUF matrices -> kernels


def matrix_shape(data: np.ndarray, kind: str) -> tuple[int, int]:
    """The [N, K] matrix raw rows of `kind` blocks hold."""
    weights, size = (BLOCK, BLOCK_BYTES[kind]) if kind in BLOCK_BYTES else KQUANT_BLOCK[kind]
    return data.shape[0], data.shape[1] // size * weights


def decoded(data: np.ndarray, kind: str) -> np.ndarray:
    """Raw rows of any block type minillm reads -> float32 [N, K]."""
    return dequantize_blocks(data, kind) if kind in BLOCK_BYTES else dequantize_kquant(data, kind)


def int4_codes(data: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4-bit rows -> (codes [N, K], scale, zero [N, K / 32]) with w = (q − 8)·scale + zero, as the kernel computes:
    Q4_1 zero = m + 8·d, Q4_0 zero 0, Q4_K scale = d·scale_j and zero = 8·d·scale_j − dmin·min_j."""
    if kind == "Q4_K":
        q, scale, offset = decode_kquant(data, kind)
        return q, scale, offset + 8 * scale
    q, d, m = decode_blocks(data, kind)
    return q, d, d * 8 + m if m is not None else np.zeros_like(d)


def int4_linear_from_blocks(data: np.ndarray, kind: str, compute_dtype=torch.bfloat16,
                            name: str = "weight") -> Int4WeightLinear:
    """4-bit rows (Q4_0, Q4_1, Q4_K) -> the int4 kernel, code for code (`int4_codes`)."""
    return int4_linear_from_parts([(data, kind)], compute_dtype, name)


def int4_linear_from_parts(parts: list[tuple[np.ndarray, str]], compute_dtype=torch.bfloat16,
                           name: str = "weight", device="cpu") -> Int4WeightLinear:
    """Stacked 4-bit matrices (q/k/v, gate/up), each in its own block type, as one int4 linear on `device`."""
    for _, kind in parts:
        if kind not in NATIVE_INT4:
            raise QuantizationError(f"{name} is {kind}: the int4 kernel runs 4-bit blocks ({', '.join(NATIVE_INT4)}) "
                                    f"natively; use --quant int4 to requantize the model instead")
    q, scale, zero = (np.concatenate(column) for column in zip(*(int4_codes(data, kind) for data, kind in parts)))
    check_int4_shape(q.shape[0], q.shape[1], BLOCK, name)
    q, scale, zero = (torch.from_numpy(t).to(device) for t in (q, scale, zero))
    return Int4WeightLinear(q, scale, zero, None, compute_dtype)


def int8_linear_from_blocks(parts: list[tuple[np.ndarray, str]], compute_dtype=torch.bfloat16,
                            rows_per_chunk: int = 4096, device="cpu") -> Int8WeightLinear:
    """Rows of any block types (stacked in order) -> the int8 kernel's one scale per row, decoding a chunk of rows
    at a time.

    The kernel has no per-block scales, so each row is requantized: s = max |w| / 127,
    q' = round(w / s). A Q8_0 row whose blocks share one d keeps its codes exactly.
    """
    codes, scales = [], []
    chunks = [(data[start:start + rows_per_chunk], kind) for data, kind in parts
              for start in range(0, data.shape[0], rows_per_chunk)]
    for data, kind in chunks:
        w = torch.from_numpy(decoded(data, kind))
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes.append(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    return Int8WeightLinear(torch.cat(codes).to(device), torch.cat(scales).to(device), None, compute_dtype)


def gguf_path_for(name_or_path: str) -> Path:
    """The GGUF file a model name stands for: the default model's, or a .gguf path given directly."""
    if name_or_path in DEFAULT_ALIASES:
        return default_gguf_path()
    if name_or_path == GEMMA3_MODEL:
        resolve_checkpoint_folder(name_or_path)  # fetched (and its split parts joined) on first use
        return gemma3_source().path
    if str(name_or_path).endswith(".gguf") and Path(name_or_path).is_file():
        return Path(name_or_path)
    raise QuantizationError(f"--quant gguf runs a GGUF file's own blocks, and {name_or_path!r} is not a GGUF: "
                            f"use --model default, {GEMMA3_MODEL} or a .gguf path, or --quant int4 to quantize this "
                            f"model")


@torch.no_grad()
def use_gguf_weights(model: nn.Module, gguf_path: str | Path, compute_dtype=torch.bfloat16,
                     head: str = "int8") -> nn.Module:
    """Swap a loaded llama-architecture model's linears for the GGUF's own blocks, in place; returns the model.

    Each matrix stored in 4-bit blocks (Q4_0, Q4_1, Q4_K) goes to the int4 kernel as it is
    stored; one in wider blocks (Q8_0, Q5_0, Q5_1, Q6_K) to the int8 kernel's rows (see the
    module docstring); q and k rows are put back in Hugging Face's rotary order (a row
    permutation: blocks lie within rows, so whole blocks move), and the q/k/v and gate/up
    matrices are stacked as `model.py` fuses them. The head goes to int8 rows, or with
    `head="int4"` to int4 groups of 32 requantized from its decoded rows (faster, less
    exact), or with "none" stays as loaded (the block matrices alone). Everything else
    (norms, the embedding lookup) stays as loaded. Every tensor is checked before any
    linear is replaced. The kernels are made on the device the model lies on (a GPU's int4 layout is its own).
    """
    reader, meta = read_gguf(Path(gguf_path))
    architecture = meta.get("general.architecture")
    if architecture not in ROPE_PERMUTED:
        raise QuantizationError(f"{gguf_path} is a {architecture!r} GGUF: --quant gguf maps "
                                f"{' and '.join(ROPE_PERMUTED)} files; use --quant int4 for this model")
    permuted = ROPE_PERMUTED[architecture]
    tensors = {t.name: t for t in reader.tensors}
    config, device = model.config, next(model.parameters()).device

    def rows(name: str, heads: int | None = None) -> tuple[np.ndarray, str]:
        if name not in tensors:
            raise QuantizationError(f"{gguf_path} lacks tensor {name}: it is not this model's GGUF")
        t = tensors[name]
        data = np.asarray(t.data)
        return (unpermute_rope(data, heads) if heads and permuted else data), t.tensor_type.name

    plan = []  # (module name, [(raw rows, block type), ...] stacked in order)
    for i in range(config.n_layer):
        b = f"blk.{i}."
        plan += [
            (f"blocks.{i}.attn.qkv", [rows(b + "attn_q.weight", config.n_head),
                                      rows(b + "attn_k.weight", config.kv_heads), rows(b + "attn_v.weight")]),
            (f"blocks.{i}.attn.proj", [rows(b + "attn_output.weight")]),
            (f"blocks.{i}.mlp.fc", [rows(b + "ffn_gate.weight"), rows(b + "ffn_up.weight")]),
            (f"blocks.{i}.mlp.proj", [rows(b + "ffn_down.weight")]),
        ]
    if head not in ("int8", "int4", "none"):
        raise QuantizationError(f"unknown head {head!r}: use int8, int4 or none")
    if head != "none":
        plan.append(("lm_head", [rows("output.weight" if "output.weight" in tensors else "token_embd.weight")]))
    for name, parts in plan:
        linear = model.get_submodule(name)
        for _, kind in parts:
            if kind not in (*NATIVE_INT4, *INT8_ROWS):
                raise QuantizationError(f"{name} is stored as {kind}: --quant gguf runs {', '.join(NATIVE_INT4)} "
                                        f"blocks on the int4 kernel and {', '.join(INT8_ROWS)} on the int8 kernel; "
                                        f"use --quant int4 to requantize this model")
        shapes = [matrix_shape(data, kind) for data, kind in parts]
        shape = (sum(n for n, _ in shapes), shapes[0][1])
        if shape != (linear.out_features, linear.in_features) or len({k for _, k in shapes}) > 1:
            raise QuantizationError(f"{name}: the GGUF holds a {list(shape)} matrix but the model has "
                                    f"{[linear.out_features, linear.in_features]}; load the model this GGUF belongs to")
        if runs_int4(name, parts, head):
            check_int4_shape(*shape, BLOCK, name)
            check_int4_dtype(linear.weight.device, compute_dtype)
    for name, parts in tqdm(plan, desc="GGUF blocks -> kernels", unit="linear", leave=False):
        if name == "lm_head" and head == "int4":  # requantized from the decoded rows: faster, less exact
            w = torch.from_numpy(np.concatenate([decoded(data, kind) for data, kind in parts])).to(device)
            new = Int4WeightLinear(*quantize_int4_groupwise(w, BLOCK), None, compute_dtype)
        elif runs_int4(name, parts, head):
            new = int4_linear_from_parts(parts, compute_dtype, name, device)
        else:
            new = int8_linear_from_blocks(parts, compute_dtype, device=device)
        replace_module(model, name, new)
    return model


def runs_int4(name: str, parts: list[tuple[np.ndarray, str]], head: str) -> bool:
    """Whether a matrix goes to the int4 kernel code for code: every part stored in 4-bit blocks (a fused matrix
    whose parts mix 4-bit and wider blocks goes to int8 rows whole); the head as `head` says."""
    if name == "lm_head" and head == "int4":
        return True
    return all(kind in NATIVE_INT4 for _, kind in parts)


def apply_quantization(model: nn.Module, method: str, name_or_path: str) -> nn.Module:
    """The CLI's --quant: "gguf" runs the model's GGUF blocks (`name_or_path` says which file), the rest
    `minillm.speed.quantize_model.quantize_model`; int4 in groups of 32 (the finest the kernel offers) with an int8 head,
    as the GGUF path has (a 4-bit head costs more accuracy than every other matrix together: lesson 14)."""
    if method == "mxfp4":
        return experts_in_mxfp4(model)
    if model.config.num_experts:
        raise ValueError(f"--quant {method}: the quantized kernels cover linear layers, not a mixture of experts' "
                         f"stacked expert weights: keep those in MXFP4 (--quant mxfp4) or run in float")
    if model.config.kv_lora_rank:
        raise ValueError(f"--quant {method}: latent attention reads its up-projection's weights directly (absorbed "
                         f"into the queries), which a quantized layer does not hold: drop --quant")
    if method == "gguf":
        return use_gguf_weights(model, gguf_path_for(name_or_path))
    return quantize_model(model, method, head="int8" if method == "int4" else None)


__all__ = ["apply_quantization", "BLOCK_BYTES", "decode_blocks", "dequantize_blocks", "encode_blocks",
           "int4_linear_from_blocks", "int4_linear_from_parts", "int8_linear_from_blocks", "gguf_path_for",
           "use_gguf_weights"]
