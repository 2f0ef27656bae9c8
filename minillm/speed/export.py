"""`python -m minillm.export onnx`: the model as two ONNX graphs with the KV cache as inputs and outputs (lesson 15).

An accelerator compiler (Qualcomm's Cloud AI 100 is the example this lesson follows)
wants one static graph: no Python, no growing tensors, the KV cache passed in and
out. The exported graph is the model's forward over a cache of fixed length
`context`:

    inputs   input_ids [1, T] (int64), position_ids [1, T] (int64),
             past_key.0 .. past_key.{L-1}, past_value.0 .. past_value.{L-1}  [1, n_kv_head, context, head_dim]
    outputs  logits [1, T, vocab] (float32),
             present_key.0 .., present_value.0 ..                              [1, n_kv_head, context, head_dim]

Token t's keys and values are written at column position_ids[t] of the cache, and
the attention mask is computed inside the graph from the positions (a token sees
the columns up to its own position), so the caller passes no mask. The graph is
specialised twice, as the Cloud AI 100 recipe compiles it twice: `prefill.onnx`
with T = `chunk` (a prompt goes through in chunks) and `decode.onnx` with T = 1.
Both graphs read one weights file (`weights.data`). `minillm.speed.onnx_model` runs them
with onnxruntime.

The export goes through `torch.onnx.export(..., dynamo=True)`: `torch.export`
traces the same pure function that `minillm.speed.compile` compiles
(`minillm.speed.compile.graph_forward`), so the graph holds no data-dependent Python and
one trace per specialisation suffices. (The older TorchScript exporter,
`dynamo=False`, is faster here but deprecated since PyTorch 2.9.)

    python -m minillm.export onnx --out exports/smollm2 --context 512 --chunk 64
    python -m minillm.export run exports/smollm2 --prompt "What is the capital of France?"
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..base import jsonio
from .graph_forward import graph_forward, graph_ready_copy
from .onnx_model import FORMAT, GRAPHS, MANIFEST, WEIGHTS, input_names, output_names

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


class StepGraph(nn.Module):
    """The exported function: tokens, positions and past keys/values in; logits and present keys/values out."""

    def __init__(self, model, context: int):
        super().__init__()
        self.model, self.context = graph_ready_copy(model), context

    def forward(self, tokens, positions, *past):
        n = len(past) // 2
        columns = torch.arange(self.context, device=tokens.device)
        mask = columns <= positions[:, :, None]  # [1, T, context]: a token sees the columns up to its position
        logits, keys, values = graph_forward(self.model, tokens, positions, positions, mask, None, past[:n], past[n:],
                                             in_place=False)
        return (logits, *keys, *values)


def example_inputs(model, tokens: int, context: int) -> tuple:
    c = model.config
    past = [torch.zeros(1, c.kv_heads, context, c.head_size, dtype=model.dtype) for _ in range(2 * c.n_layer)]
    return (torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens)[None], *past)


def export_graph(step: StepGraph, tokens: int, path: Path) -> None:
    """Trace `step` with T = `tokens` and write `path` plus its weights beside it (`path`.data)."""
    n_layer = step.model.config.n_layer
    # The exporter logs a line per optional package it lacks (torchvision) and warns about its own internals:
    # nothing a user of this command can act on.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.onnx.export(step, example_inputs(step.model, tokens, step.context), dynamo=True,
                                    input_names=input_names(n_layer), output_names=output_names(n_layer),
                                    external_data=True, optimize=True, verbose=False)
    program.save(str(path), external_data=True)


def share_weights(folder: Path, names: list[str]) -> None:
    """Point every graph's weights at one file, `weights.data`, storing each distinct tensor once.

    Each exported graph comes with its own copy of the weights; the two copies are
    byte for byte the same tensors, so the second graph's initializers are pointed
    at the first one's bytes (matched by content, not by name: an exporter names
    folded constants as it likes).
    """
    import onnx

    stored: dict[tuple, tuple[int, int]] = {}  # (dtype, dims, sha256) -> (offset, length) in weights.data
    with open(folder / WEIGHTS, "wb") as out:
        for name in names:
            proto = onnx.load(str(folder / name), load_external_data=True)
            for tensor in proto.graph.initializer:
                data = onnx.numpy_helper.to_array(tensor).tobytes()
                if len(data) < 1024:  # scalars and small constants stay inside the graph
                    continue
                key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(data).hexdigest())
                if key not in stored:
                    stored[key] = (out.tell(), len(data))
                    out.write(data)
                offset, length = stored[key]
                for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
                    tensor.ClearField(field)
                del tensor.external_data[:]
                for field, value in (("location", WEIGHTS), ("offset", offset), ("length", length)):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = field, str(value)
                tensor.data_location = onnx.TensorProto.EXTERNAL
            onnx.save_model(proto, str(folder / name))
            (folder / (name + ".data")).unlink(missing_ok=True)


def stamp(path: Path, export_id: str) -> None:
    """Record the export's id in the graph's metadata: the runner refuses graphs from another export."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    entry = proto.metadata_props.add()
    entry.key, entry.value = "minillm.export_id", export_id
    onnx.save_model(proto, str(path))


def export_onnx(model, out: str | Path, context: int, chunk: int, model_name: str = "", checkpoint=None) -> Path:
    """Write `prefill.onnx`, `decode.onnx`, `weights.data` and `manifest.json` (plus the tokenizer) to `out`.

    The folder is built under a temporary name beside `out` and renamed into place at
    the end, so an interrupted export never leaves a half-written folder behind.
    """
    c = model.config
    check_sizes(context, chunk)
    if context > c.context_length:
        raise ValueError(f"--context {context} is longer than the model's context ({c.context_length}): "
                         f"use at most {c.context_length}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        step = StepGraph(model, context).eval()
        export_id = uuid.uuid4().hex
        stages = [(f"trace prefill (T={chunk})", lambda: export_graph(step, chunk, work / GRAPHS["prefill"])),
                  ("trace decode (T=1)", lambda: export_graph(step, 1, work / GRAPHS["decode"])),
                  ("write weights.data once", lambda: share_weights(work, list(GRAPHS.values()))),
                  ("stamp", lambda: [stamp(work / name, export_id) for name in GRAPHS.values()])]
        with tqdm(stages, desc="export", unit="step", disable=None) as progress:
            for label, action in progress:
                progress.set_postfix_str(label)
                action()
        for name in TOKENIZER_FILES:
            if checkpoint is not None and (Path(checkpoint) / name).exists():
                shutil.copy(Path(checkpoint) / name, work / name)
        jsonio.write_json(work / MANIFEST, {
            "format": FORMAT, "export_id": export_id, "model": model_name, "dtype": str(model.dtype).split(".")[-1],
            "context": context, "chunk": chunk, "n_layer": c.n_layer, "n_kv_head": c.kv_heads,
            "head_dim": c.head_size, "vocab_size": c.vocab_size, "graphs": GRAPHS,
            "model_type": jsonio.read_json(work / "config.json").get("model_type", "")
            if (work / "config.json").exists() else ""})
        umask = os.umask(0)
        os.umask(umask)
        work.chmod(0o777 & ~umask)  # a temporary folder is private; the export is an ordinary folder
        replace_folder(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def check_sizes(context: int, chunk: int) -> None:
    """Refuse impossible graph sizes before the (slow) model load and trace."""
    if context < 1:
        raise ValueError(f"--context {context} is invalid: the cache must hold at least 1 token")
    if not 1 <= chunk <= context:
        raise ValueError(f"--chunk {chunk} is invalid: it must be between 1 and --context ({context})")


def replace_folder(new: Path, target: Path) -> None:
    """Move `new` to `target`, replacing a previous export there only once the new one is complete."""
    old = None
    if target.exists():
        if not (target / MANIFEST).exists():
            raise ValueError(f"{target} exists and is not a minillm export: choose another --out")
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
