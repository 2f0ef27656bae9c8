"""`load_model`: a model read from its checkpoint (`minillm.model.loading`), then given this machine's fast paths."""

from __future__ import annotations

import torch

from ..model.loading import read_model
from .onednn import use_onednn


def load_model(name_or_path: str = "default", dtype: str | torch.dtype = "float32", device: str = "cpu",
               fast: bool = True):
    """Return (model, tokenizer) ready for inference (eval mode, no grad needed).

    name_or_path: "default" (SmolLM2-135M-Instruct), "gemma3-270m", a local Hugging Face folder or GGUF
    file, or a hub name. fast: apply the hardware fast paths as module swaps after loading (today:
    oneDNN float32 matmuls on a CPU, `minillm.speed.onednn`); False keeps the plain from-scratch model.
    """
    model, tokenizer = read_model(name_or_path, dtype, device)
    if fast and model.device.type == "cpu" and model.dtype == torch.float32:
        use_onednn(model)
    return model, tokenizer
