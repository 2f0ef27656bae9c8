"""`load_model`: a model read from its checkpoint (`minillm.model.loading`), then given this machine's fast paths."""

from __future__ import annotations

import torch

from ..model.loading import conversion_source, read_model, read_tokenizer, resolve_checkpoint_folder, resolve_dtype
from .huge_pages import defer_placement, model_into_huge_pages
from .onednn import use_onednn
from .prepared import keep_prepared, load_prepared, loaded_bytes_identity
from .quant import GPU_METHODS
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
    loading (on a GPU, onto the weights already there: int8, int4 and the GGUF's blocks); refused before
    anything loads on a device its kernels do not run on (`quant_refusal`).
    defer_huge_pages: leave the copy into huge pages to the runner that decodes with the model
    (`minillm.speed.huge_pages.defer_placement`): a one-shot run through kept graphs skips it, reads the graphs'
    own copies where their files are mapped (`minillm.speed.graph_store.PackagedStep`) and prefills on plain
    `F.linear` (`minillm.runtime.runner`).
    """
    refused = quant_refusal(quant, device)
    if refused:
        raise ValueError(refused)
    identity = None  # one of minillm's own conversions loads from what an earlier start kept, if one did
    if device_kind(device) == "cpu" and conversion_source(name_or_path):
        torch_dtype = resolve_dtype(dtype)  # a bad dtype is named before anything is read
        folder = resolve_checkpoint_folder(name_or_path)
        identity = loaded_bytes_identity(name_or_path, torch_dtype, fast, quant)
    model = load_prepared(identity, folder) if identity else None
    if model is None:
        model, tokenizer = read_model(name_or_path, dtype, device)
        if quant != "none":
            apply_quantization(model, quant, name_or_path)
        if identity:
            keep_prepared(model, identity)
    else:
        tokenizer = read_tokenizer(folder)
    if fast and model.device.type == "cpu" and model.dtype == torch.float32:  # the linears quantization left
        use_onednn(model)
    if fast and model.device.type == "cpu":  # last: the quantized blocks are weights too
        if defer_huge_pages:
            defer_placement(model)
        else:
            model_into_huge_pages(model)
    if identity:
        remember_across_runs(model, identity)
    return model, tokenizer


def quant_refusal(quant: str, device: str) -> str | None:
    """Why `--quant quant` cannot run on `device`, in one line; None where it can (or where the device itself is
    the problem, which loading names)."""
    kind = device_kind(device)
    if quant == "none" or kind in ("cpu", None) or kind == "cuda" and quant in (*GPU_METHODS, "gguf"):
        return None
    if kind == "cuda":
        return (f"--quant {quant} runs CPU kernels (lesson 14), not on {device}: on a GPU use --quant int8, int4 or "
                f"gguf, or drop --device")
    return f"--quant {quant} runs CPU kernels (lesson 14), not on {device}: drop --device, or --quant"


def device_kind(device: str) -> str | None:
    """'cpu', 'cuda', ... for a device name; None for a name torch does not know (`read_model` reports it)."""
    try:
        return torch.device(device).type
    except RuntimeError:
        return None
