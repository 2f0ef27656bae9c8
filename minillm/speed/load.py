"""`load_model`: a model read from its checkpoint (`minillm.model.loading`), then given this machine's fast paths."""

from __future__ import annotations

import hashlib
import json

import torch

from ..base.manifest import read_manifest
from ..model.loading import conversion_source, read_model
from .graph_store import source_digest
from .huge_pages import defer_placement, model_into_huge_pages
from .onednn import use_onednn
from .quant_gguf import apply_quantization
from .weights_digest import remember_across_runs


def load_model(name_or_path: str = "default", dtype: str | torch.dtype = "float32", device: str = "cpu",
               fast: bool = True, quant: str = "none", defer_huge_pages: bool = False):
    """Return (model, tokenizer) ready for inference (eval mode, no grad needed).

    name_or_path: "default" (SmolLM2-135M-Instruct), "gemma3-270m", a local Hugging Face folder or GGUF
    file, or a hub name. fast: apply the hardware fast paths after loading (on a CPU: oneDNN float32 matmuls,
    `minillm.speed.onednn`, as module swaps, and every weight in huge pages, `minillm.speed.huge_pages`);
    False keeps the plain from-scratch model.
    quant: "none", or a quantization the command line offers (`apply_quantization`), swapped in after
    loading; refused before anything loads on a device its kernels do not run on.
    defer_huge_pages: leave the copy into huge pages to the runner that decodes with the model
    (`minillm.speed.huge_pages.defer_placement`): a run whose kept graphs hold their own copies skips it, and
    their copies stay where their files are mapped (a one-shot run: `minillm.speed.graph_store.PackagedStep`).
    """
    if quant != "none" and device_kind(device) not in ("cpu", None):
        raise ValueError(f"--quant {quant} runs CPU kernels (lesson 14), not on {device}: drop --device, or --quant")
    model, tokenizer = read_model(name_or_path, dtype, device)
    if fast and model.device.type == "cpu" and model.dtype == torch.float32:
        use_onednn(model)
    if quant != "none":
        apply_quantization(model, quant, name_or_path)
    if fast and model.device.type == "cpu":  # last: the quantized blocks are weights too
        if defer_huge_pages:
            defer_placement(model)
        else:
            model_into_huge_pages(model)
    identity = loaded_bytes_identity(name_or_path, model, fast, quant)
    if identity is not None:
        remember_across_runs(model, identity)
    return model, tokenizer


def loaded_bytes_identity(name_or_path: str, model, fast: bool, quant: str) -> str | None:
    """A sha256 of everything the loaded model's bytes depend on, where the loader knows them all: a conversion of
    minillm's own (the files' sha256 its manifest recorded, checked by their stat as it loaded), the options, the
    source of the code that converts and quantizes, torch's version. None for a folder or hub checkpoint."""
    source = conversion_source(name_or_path)
    manifest = read_manifest(source.entry) if source is not None else None
    if manifest is None:
        return None
    parts = {"files": {name: record["sha256"] for name, record in manifest["files"].items()},
             "source": manifest["source"]["sha256"], "dtype": str(model.dtype), "device": str(model.device),
             "fast": fast, "quant": quant, "code": source_digest(), "torch": torch.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def device_kind(device: str) -> str | None:
    """'cpu', 'cuda', ... for a device name; None for a name torch does not know (`read_model` reports it)."""
    try:
        return torch.device(device).type
    except RuntimeError:
        return None
