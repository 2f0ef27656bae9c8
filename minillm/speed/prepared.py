"""Loaded models kept on disk: a later start maps the tensors an earlier load built instead of building them again.

Every start used to rebuild the same bytes: `--quant gguf` parsed the GGUF's metadata
(the tokenizer's 49,152 strings, ~1.5 s on the course's 2-core AMD EPYC) and re-laid its
blocks out for the int4 kernel (~0.5 s), `--quant int8` quantized 121 matrices (~1 s), and
float32 stacked q/k/v and gate/up into fused matrices (~0.15 s). What a load builds
depends only on the checkpoint's bytes, the options and the code that converts and
quantizes, which `loaded_bytes_identity` hashes: a model loaded from one of minillm's own
conversions is kept under $MINILLM_HOME/prepared/<identity> the first time (its tensors
with `torch.save`, each quantized module's class and plain attributes as JSON, a manifest
of both), and a later start rebuilds the modules empty and maps the tensors in with
`torch.load(mmap=True)`: no copy, and pages the run never reads are never read. The file
is mapped copy-on-write, so a model edited in place never writes to it. Keeping an entry
removes those another version of the code kept, which no later start could load.

Nothing unverified is loaded: the manifest's check before every load (`graph_store.entry_problem`:
sizes and stats, sha256 where a stat changed or MINILLM_VERIFY=1 asks), tensors only
(`weights_only`), and module classes only from `QUANTIZED_CLASSES`. A damaged or partly written
entry is rebuilt from the checkpoint, as a kept graph is (`minillm.speed.graph_store`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from ..base.files import cache_lock, minillm_home, remove, remove_unusable_siblings, replace_folder, temporary_path
from ..base.jsonio import write_json
from ..base.manifest import file_record, read_manifest, write_manifest
from ..model.checkpoint import config_from_hf, empty_model
from ..model.fetch import read_json
from ..model.loading import conversion_source
from .graph_store import entry_problem, source_digest
from .quant import DynamicInt8Linear, Int4WeightLinear, Int8WeightLinear, QuantizedLinear, StaticInt8Linear
from .quantize_model import replace_module

STATE = "state.pt"  # the model's tensors, as `state_dict` gives them
MODULES = "modules.json"  # each quantized module: its class and plain attributes
KEY = "key.json"  # the identity the entry was written for, in full, and the code that wrote it (`this_code`)
QUANTIZED_CLASSES = {cls.__name__: cls for cls in (Int8WeightLinear, Int4WeightLinear, DynamicInt8Linear,
                                                   StaticInt8Linear)}


def loaded_bytes_identity(name_or_path: str, dtype: torch.dtype, fast: bool, quant: str) -> str | None:
    """A sha256 of everything a CPU load's bytes depend on, where the loader knows them all: a conversion of
    minillm's own (the files' sha256 its manifest recorded, checked by their stat as it was resolved), the options,
    the source of the code that converts and quantizes, torch's version. None for a folder or hub checkpoint."""
    source = conversion_source(name_or_path)
    manifest = read_manifest(source.entry) if source is not None else None
    if manifest is None:
        return None
    parts = {"files": {name: record["sha256"] for name, record in manifest["files"].items()},
             "source": manifest["source"]["sha256"], "dtype": str(dtype), "fast": fast, "quant": quant, **this_code()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def prepared_folder(identity: str) -> Path:
    return minillm_home() / "prepared" / identity[:24]


def module_spec(module: QuantizedLinear) -> dict:
    """A quantized module's class, plain attributes (sizes, group size, compute dtype) and which of its tensors are
    parameters: with the tensors themselves, all it is made of."""
    plain = {name: str(value) if isinstance(value, torch.dtype) else value for name, value in vars(module).items()
             if not name.startswith("_") and name != "training"}
    return {"class": type(module).__name__, "attributes": plain, "parameters": list(module._parameters),
            "buffers": list(module._buffers)}


def restored_module(spec: dict, state: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    """A module of a kept class rebuilt from its spec and its tensors in `state` (under `prefix`), without running
    its constructor (which would quantize or re-lay out again)."""
    cls = QUANTIZED_CLASSES[spec["class"]]
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, value in spec["attributes"].items():
        is_dtype = isinstance(value, str) and value.startswith("torch.")
        setattr(module, name, getattr(torch, value.removeprefix("torch.")) if is_dtype else value)
    for name in spec["parameters"]:
        module.register_parameter(name, nn.Parameter(state[prefix + name], requires_grad=False))
    for name in spec["buffers"]:
        module.register_buffer(name, state[prefix + name])
    return module


def keep_prepared(model: nn.Module, identity: str) -> None:
    """Write the loaded model under its identity (once: another process may have written it while we waited)."""
    folder = prepared_folder(identity)
    with cache_lock():
        if entry_problem(folder) is None:
            return
        built = temporary_path(folder)
        built.mkdir(parents=True)
        try:
            torch.save(model.state_dict(), built / STATE)
            write_json(built / MODULES, {name: module_spec(module) for name, module in model.named_modules()
                                         if isinstance(module, QuantizedLinear)})
            write_json(built / KEY, {"identity": identity, **this_code()})
            write_manifest(built, file_record(built / KEY))
            replace_folder(built, folder)
        finally:
            remove(built)
        remove_unusable_siblings(folder, lambda other: kept_by(other) == this_code())


def this_code() -> dict:
    """The code a kept model's bytes come from, besides the checkpoint and the options."""
    return {"code": source_digest(), "torch": torch.__version__}


def kept_by(folder: Path) -> dict | None:
    """The code that kept the model in `folder` (`this_code` as it was then), or None where it cannot be read."""
    try:
        key = json.loads((folder / KEY).read_text())
        return {"code": key["code"], "torch": key["torch"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_prepared(identity: str, checkpoint: Path) -> nn.Module | None:
    """The model kept under `identity` (its tensors mapped from the file), or None when there is none intact.

    checkpoint: the conversion it was loaded from, whose config.json says what to build."""
    folder = prepared_folder(identity)
    if entry_problem(folder) is not None:
        return None
    config = config_from_hf(read_json(checkpoint / "config.json"))
    model, state = empty_model(config), torch.load(folder / STATE, mmap=True, weights_only=True)
    for name, spec in json.loads((folder / MODULES).read_text()).items():
        replace_module(model, name, restored_module(spec, state, name + "."))
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings and type(model.lm_head) is nn.Linear:
        model.lm_head.weight = model.tok_emb.weight  # `assign` gave each name its own Parameter: tie again
    return model.eval()


__all__ = ["QUANTIZED_CLASSES", "keep_prepared", "load_prepared", "loaded_bytes_identity", "prepared_folder"]
