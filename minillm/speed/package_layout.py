"""How a built step's files are laid out for AOTInductor's loader: its library as is, only the constants it made.

`torch._inductor.aoti_compile_and_package` writes what AOTInductor produced (the shared
library, its sources and metadata, and every constant) into one `.pt2` zip archive; the
kept-graph cache used to write it, unpack it to a folder (the loader then extracts nothing
at each load) and delete the constants that only repeat the model's own tensors. For the
default model that wrote 1.1 GB twice to keep half of it once: 5.2 s of a 50 s build.
Here the files go straight into the folder layout the archive would unpack to (2.0 s):

    step/data/aotinductor/model/   the library, its sources, its metadata, weights_config.json
                                   (every constant: its file, shape, stride and offset)
    step/data/weights/weight_N     one pickled tensor per group of constants sharing a storage

and a constant group that equals one of the model's own tensors (same name, layout and
bytes) is not written at all: it is recorded in `shared` and given from the model at load
(the model is loaded anyway). Inductor re-lays out most matmul weights for its own kernels
(new constants, written); the embedding and norms it uses as they are (shared).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

MODEL_FILES = "data/aotinductor/model"  # under the package folder, as the `.pt2` archive's paths
WEIGHT_FILES = "data/weights"
WEIGHTS_CONFIG = "weights_config.json"  # AOTInductor's: constant -> [its file, shape, stride, offset]


def model_tensors(module: torch.nn.Module, every_name: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module`, by name; every_name: a tensor held under two names (a tied
    embedding and output head) under both, not only the first."""
    return {**dict(module.named_parameters(remove_duplicate=not every_name)),
            **dict(module.named_buffers(remove_duplicate=not every_name))}


def write_package(files: list, folder: Path, model: torch.nn.Module) -> dict[str, str]:
    """Lay out `torch._inductor.aot_compile(..., options={"aot_inductor.package": True})`'s output in `folder`; the
    constants left to the model at load, {constant: the model's tensor name}.

    files: AOTInductor's list, paths of the files it wrote and one `Weights` (constant name ->
    its tensor and where that tensor sits in its storage). The step is traced from a copy of
    the model (`CacheStep.model`), so constants named `model.<the model's name>` may be its own."""
    from torch.export.pt2_archive._package_weights import Weights, get_complete_tensor, group_weights

    model_files, weight_files = folder / MODEL_FILES, folder / WEIGHT_FILES
    model_files.mkdir(parents=True)
    weight_files.mkdir(parents=True)
    weights = Weights({})
    for file in files:
        if isinstance(file, Weights):
            weights = file
        elif file:
            shutil.copyfile(file, model_files / Path(file).name)
    live, config, shared = model_tensors(model, every_name=True), {}, {}
    for index, group in enumerate(group_weights({"model": weights})):
        filename = f"weight_{index}"
        names = [name for _, name in group]
        for name in names:
            where = weights.get_weight_properties(name)
            config[name] = [filename, list(where.shape), list(where.stride), where.offset]
        own = {name: _models_own(weights, name, live) for name in names}
        if all(own.values()):
            shared.update(own)
        else:
            torch.save(get_complete_tensor(group, {"model": weights}), weight_files / filename)
    (model_files / WEIGHTS_CONFIG).write_text(json.dumps(config))
    return shared


def _models_own(weights, name: str, live: dict[str, torch.Tensor]) -> str | None:
    """The model's name for constant `name` if the constant is that tensor, same layout and bytes; else None."""
    tensor, where = weights.get_weight(name)
    own = live.get(name.removeprefix("model."))
    if (own is None or where.offset or list(own.shape) != list(where.shape) or list(own.stride()) != list(where.stride)
            or own.dtype != tensor.dtype or not torch.equal(own.detach(), tensor)):
        return None
    return name.removeprefix("model.")


__all__ = ["MODEL_FILES", "WEIGHTS_CONFIG", "WEIGHT_FILES", "model_tensors", "write_package"]
