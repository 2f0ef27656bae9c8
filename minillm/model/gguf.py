"""GGUF, llama.cpp's file format: read it checked, map its names onto Hugging Face's, convert it to a folder.

A GGUF file holds metadata (architecture, sizes, the tokenizer) and quantized tensors.
`read_gguf` refuses a truncated or corrupt file in one line; `GGUF_FAMILIES` says, per
architecture, how llama.cpp's tensor names and layouts map back to Hugging Face's (RoPE
rows reordered, Gemma's norms stored with the +1 added); `gguf_to_hf_folder` dequantizes
every tensor with the `gguf` package and writes an ordinary checkpoint folder that
`minillm.model.checkpoint` reads. `minillm.model.loading` keeps the converted folders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..base.files import one_line
from .checkpoint import refuse_non_finite
from .families import UnsupportedModel
from .fetch import ModelLoadError
from .tokenizer import tokenizer_from_gguf_metadata


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face rotates the
    halves (x_i, x_{i + d/2}). Its converter permutes each head's rows so the GGUF works
    with the interleaved kernel; this reverses that permutation.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LLAMA_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GEMMA3_GGUF_NAMES = {
    **LLAMA_GGUF_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# What Gemma 3 270M's GGUF does not record, from its published Hugging Face config
# (google/gemma-3-270m, config.json): the sliding layers' RoPE base, the pattern of five
# sliding layers then one global layer, and the attention scale.
GEMMA3_270M_MISSING = {"rope_local_base_freq": 10000.0, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}


def llama_gguf_config(a: Callable[[str], object]) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rope_theta": a("rope.freq_base"), "rms_norm_eps": a("attention.layer_norm_rms_epsilon")}


def gemma3_gguf_config(a: Callable[[str], object]) -> dict:
    layers, pattern = a("block_count"), GEMMA3_270M_MISSING["sliding_window_pattern"]
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": a("attention.key_length"), "sliding_window": a("attention.sliding_window"),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "rope_theta": a("rope.freq_base"), "rope_local_base_freq": GEMMA3_270M_MISSING["rope_local_base_freq"],
        "query_pre_attn_scalar": GEMMA3_270M_MISSING["query_pre_attn_scalar"], "rope_scaling": None,
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }


def llama_gguf_tensor(name: str, values: np.ndarray, hf: dict) -> np.ndarray:
    if name.endswith("attn_q.weight"):
        return unpermute_rope(values, hf["num_attention_heads"])
    if name.endswith("attn_k.weight"):
        return unpermute_rope(values, hf["num_key_value_heads"])
    return values


def gemma_gguf_tensor(name: str, values: np.ndarray, hf: dict) -> np.ndarray:
    """llama.cpp's converter stores Gemma's norm weights with the 1 of x̂·(1 + w) added: take it off."""
    return values - np.float32(1.0) if name.endswith("norm.weight") else values


@dataclass(frozen=True)
class GGUFFamily:
    """How a GGUF architecture becomes a transformers checkpoint folder."""

    architecture: str  # `general.architecture`
    hf_config: Callable[[Callable[[str], object]], dict]  # the family's config.json keys, from GGUF metadata
    layer_names: dict[str, str]  # llama.cpp's per-layer tensor names -> transformers'
    tensor: Callable[[str, np.ndarray, dict], np.ndarray]  # undo what llama.cpp's converter changed

    def hf_name(self, name: str) -> str | None:
        """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight (None: not a tensor of this family)."""
        fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
        if name in fixed:
            return fixed[name]
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if not m or m.group(2) not in self.layer_names:
            return None
        return f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}.weight"


GGUF_FAMILIES = {f.architecture: f for f in (
    GGUFFamily("llama", llama_gguf_config, LLAMA_GGUF_NAMES, llama_gguf_tensor),
    GGUFFamily("gemma3", gemma3_gguf_config, GEMMA3_GGUF_NAMES, gemma_gguf_tensor),
)}


def gguf_family_for(architecture) -> GGUFFamily:
    if architecture not in GGUF_FAMILIES:
        raise UnsupportedModel(f"unsupported GGUF architecture {architecture!r}: minillm converts "
                               f"{', '.join(GGUF_FAMILIES)} GGUF files")
    return GGUF_FAMILIES[architecture]


def read_gguf(path: Path):
    """Open a GGUF file: (reader, metadata dict). Corrupt or truncated files raise ModelLoadError.

    The file is read into memory first, and the `gguf` package's reader parses that: the reader
    slices its input once per metadata value and per string of the tokenizer's arrays, some
    250,000 slices for the default model, and a slice of a memory-mapped file costs about twice
    a slice of an array (the reader took 1.9 s on the memory map, 0.8 s in memory, on a 2-core
    Xeon): a `--quant gguf` start is that much sooner. The tensors are then views of those bytes.
    """
    from types import SimpleNamespace
    from unittest import mock

    from gguf import GGUFReader, gguf_reader

    # numpy as the reader's module sees it, its memmap reading the whole file instead: numpy itself is left alone
    in_memory = SimpleNamespace(**{**vars(np), "memmap": lambda file, mode="r": np.fromfile(file, dtype=np.uint8)})
    try:
        with mock.patch.object(gguf_reader, "np", in_memory):
            reader = GGUFReader(str(path))
        meta = {}
        for key, field in reader.fields.items():
            meta[key] = field.contents()
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad bytes
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {one_line(e)}") from None
    check_tensor_sizes(reader, path)
    return reader, meta


def check_tensor_sizes(reader, path: Path) -> None:
    """Each tensor's declared type and shape must fill the bytes the file gives it (up to alignment padding).

    GGUF stores no byte size per tensor, only a type, a shape and an offset. A damaged
    type would read a neighbour's bytes as this tensor's and dequantize them into
    garbage or NaN; comparing with the distance to the next tensor catches it.
    """
    tensors = sorted(reader.tensors, key=lambda t: t.data_offset)
    ends = [t.data_offset for t in tensors[1:]] + [len(reader.data)]
    for t, end in zip(tensors, ends):
        room = end - t.data_offset
        if not t.n_bytes <= room < t.n_bytes + reader.alignment:
            raise ModelLoadError(
                f"tensor {t.name} in {path} is declared {t.tensor_type.name} {[int(d) for d in t.shape]} "
                f"({t.n_bytes} bytes), but the file holds {room} bytes for it: the file is corrupt; "
                f"download or convert it again"
            )


def gguf_value(meta: dict, key: str, path: Path):
    """A metadata value the conversion cannot do without."""
    if key not in meta:
        raise ModelLoadError(f"{path} lacks the GGUF metadata key {key!r}: the file is incomplete or not a "
                             f"llama.cpp model file; convert or download it again")
    return meta[key]


def gguf_to_hf_folder(path: Path, out: Path) -> None:
    """Dequantize a GGUF (an architecture of `GGUF_FAMILIES`) into a float32 Hugging Face
    checkpoint folder `out` (created)."""
    from gguf.quants import dequantize

    reader, meta = read_gguf(path)
    arch = meta.get("general.architecture")
    try:
        family = gguf_family_for(arch)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    a = lambda key: gguf_value(meta, f"{arch}.{key}", path)
    tokens = gguf_value(meta, "tokenizer.ggml.tokens", path)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    hf_config = {
        "vocab_size": len(tokens), "hidden_size": a("embedding_length"), "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": a("block_count"), "num_attention_heads": a("attention.head_count"),
        "num_key_value_heads": a("attention.head_count_kv"), "max_position_embeddings": a("context_length"),
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32", **family.hf_config(a),
    }
    try:
        tokenizer = tokenizer_from_gguf_metadata(meta)
    except KeyError as e:
        raise ModelLoadError(f"{path} lacks the GGUF metadata key {e.args[0]!r}: the file is incomplete; "
                             f"convert or download it again") from None
    except (ValueError, IndexError, TypeError) as e:
        raise ModelLoadError(f"{path} has tokenizer metadata minillm cannot use: {one_line(e)}") from None
    weights = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        name = family.hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {path}: not a {arch}-architecture checkpoint")
        try:
            values = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"tensor {t.name} in {path} has type {t.tensor_type.name}, which cannot be "
                                 f"dequantized: {one_line(e)}") from None
        tensor = torch.from_numpy(np.array(family.tensor(t.name, values, hf_config), dtype=np.float32))
        refuse_non_finite({t.name: tensor}, path)
        weights[name] = tensor
    hf_config["tie_word_embeddings"] = "lm_head.weight" not in weights
    out.mkdir(parents=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt", "source": path.name})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": None if eos is None else tokens[eos], "bos_token": None if bos is None else tokens[bos],
        "chat_template": meta.get("tokenizer.chat_template"), "add_bos_token": tokenizer.add_bos,
    }, indent=2))


__all__ = ["GGUF_FAMILIES", "GGUFFamily", "gguf_family_for", "unpermute_rope", "read_gguf", "gguf_to_hf_folder"]
