"""A Hugging Face checkpoint folder (config.json + safetensors, or a weights-only .bin) read into our model.

Weights are only ever read from safetensors or `torch.load(weights_only=True)`: nothing
here unpickles arbitrary objects. Weights that are NaN or infinite are refused. Each
family (`minillm.model.families`) reads its config.json into a `ModelConfig` and maps its
names and layouts onto ours (`minillm.model.weight_names`).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from ..base.files import one_line
from .config import ModelConfig
from .families import FAMILIES, family_for
from .fetch import ModelLoadError, read_json
from .transformer import Transformer


def config_from_hf(hf: dict) -> ModelConfig:
    """Translate a transformers config.json into a ModelConfig (or refuse clearly): see `minillm.model.families`."""
    return family_for(hf).config(hf)


def read_hf_weights(folder: Path, checked: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: safetensors shards, else a weights-only .bin; all finite.

    checked: the folder is one of minillm's own conversions, its files unchanged since they were found finite
    when converted (`minillm.model.gguf.gguf_to_hf_folder`): not read through again (0.085 s of every default start).
    """
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"folder {folder} has no weights (*.safetensors or pytorch_model.bin)")
    weights = {}
    for file in files:
        tensors = read_weights_file(file)
        if not checked:
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


def empty_model(config: ModelConfig) -> Transformer:
    """The model's modules with their tensors on the meta device, left undrawn: a loader assigns its own
    (`load_state_dict(assign=True)`). Drawing the embedding's random start, even on meta, runs a Python kernel that
    imports torch's compiler: 2 s a start."""
    with torch.device("meta"), mock.patch.object(nn.Embedding, "reset_parameters", lambda self: None):
        return Transformer(config)


def read_checkpoint(folder: Path, checked: bool = False) -> Transformer:
    """The model a checkpoint folder holds (checked: as for `read_hf_weights`)."""
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
    weights = read_hf_weights(folder, checked)
    kind = hf["model_type"]
    try:
        state, origin = FAMILIES[kind].state(weights, config)
    except KeyError as e:
        raise ModelLoadError(f"checkpoint in {folder} lacks tensor {e.args[0]!r}: incomplete or not a {kind} model") from None
    except RuntimeError as e:  # q/k/v (or gate/up) projections that cannot be stacked
        raise ModelLoadError(f"checkpoint in {folder} does not fit its config.json: {one_line(e)}") from None
    model = empty_model(config)
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


__all__ = ["config_from_hf", "empty_model", "read_hf_weights", "read_weights_file", "refuse_non_finite", "all_finite",
           "hf_to_minillm_state", "read_checkpoint"]
