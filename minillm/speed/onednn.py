"""A CPU fast path as a module swap: float32 matmuls through oneDNN on weights packed once.

`model.py` stays plain (`nn.Linear`); `load_model` applies this swap on CPU float32
(`fast=False` turns it off), as gpt-fast applies its quantized linears after loading.

Why it pays. PyTorch's CPU `F.linear` calls MKL's sgemm, which on some x86 CPUs takes
a slow path at the shapes inference needs: a decode step multiplies 1-32 activation
rows by each weight. oneDNN (PyTorch's other CPU math library) is often much faster at
those shapes, prefill included, but only on a weight it has first reordered
("packed") into the blocked layout its kernels read. Packing costs about one pass
over the weight, so it is done on the first forward and kept (twice the weight
memory) until the weight changes. Measure it on your machine:
`python -m minillm.bench decode` runs both.

One to three rows (a batch-1 decode step, two or three sequences, a verify of a token or
two of draft) are the exception on an Intel CPU with AVX-512 (`libraries_stream_matvecs`):
there MKL's products over so few rows stream the weight faster than oneDNN's, and they
read the weight where `load_model` put it, in huge pages, where oneDNN reads its own
packed copy on ordinary pages. Measured on the course's 2-core Xeon, the default model's
layer matmuls (30 layers' fused projections) at 1/2/3/4 rows: MKL 16.1/16.4/17.9/27.4 ms,
oneDNN 23.5/24.5/26.6/24.1 ms, so MKL takes up to `MKL_MAX_ROWS`; eager decoding at batch
1, 18-20 tok/s through oneDNN, 24.7-27.5 through MKL. On the AMD EPYC (AVX2) of earlier
runs MKL's one-row product read the weights at a third of the bandwidth, oneDNN's at
half: there oneDNN keeps every shape.

A run that decodes through kept graphs (their own weights, `minillm.speed.graph_store`) multiplies
each model weight only in its prefill, once per run: packing would cost more than it saves, so
there oneDNN multiplies the plain weight (`use_unpacked_onednn`), as fast as the packed one at a
prompt's hundreds of rows. Measured on the 2-core AMD EPYC with AVX-512 (Zen 5), the default
model's 30 layers' matmuls over 805 rows: MKL 0.82 s, oneDNN 0.36 s plain and 0.35 s packed
(MKL runs its AVX2 kernels on an AMD CPU, oneDNN its AVX-512 ones).

A compiled step over any number of rows (the server's, whose rows change from step to step) calls
the same packed product as a library function, `onednn_linear`, which packs each weight the first
time it meets it and keeps the copy while the weight lives (`linears_call_onednn`,
`minillm.speed.inductor`).

The products are the same dot products summed in another order: results differ from
`F.linear` by float32 rounding, as any two BLAS libraries do. Everything else (GPUs,
bf16/fp16, training, a PyTorch without oneDNN) falls back to plain `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..base.machine import cpuinfo_field

MKL_MAX_ROWS = 3  # activation rows up to which MKL's product beats oneDNN's where `libraries_stream_matvecs`


class OneDNNLinear(nn.Linear):
    """nn.Linear whose float32 CPU inference matmul runs oneDNN on a prepacked weight."""

    packs = True  # False: oneDNN multiplies the weight as it lies (`UnpackedOneDNNLinear`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._onednn_applies(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")

    def _onednn_applies(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (x.device.type == "cpu" and w.dtype == x.dtype == torch.float32
                and not (torch.is_grad_enabled() and w.requires_grad)  # the oneDNN op has no backward
                and torch.backends.mkldnn.is_available()
                and not (x.numel() <= MKL_MAX_ROWS * x.shape[-1] and libraries_stream_matvecs()))  # MKL's is faster

    def _packed_weight(self):
        """oneDNN's copy of the weight, repacked whenever the weight is replaced or edited."""
        w = self.weight
        if not self.packs:
            return w
        key = weight_stamp(w)
        if getattr(self, "_packed_key", None) != key:
            self._packed = packed_copy(w)
            self._packed_key = key
        return self._packed

    def drop_packed_weight(self) -> None:
        for name in ("_packed", "_packed_key"):
            self.__dict__.pop(name, None)

    def _apply(self, fn, recurse=True):
        """`.to()`, `.float()`, `.cuda()` replace the weight: drop the packed copy with it."""
        self.drop_packed_weight()
        return super()._apply(fn, recurse)

    def __getstate__(self):
        """Copies and pickles leave the packed copy behind (oneDNN tensors cannot be copied)."""
        return {k: v for k, v in super().__getstate__().items() if k not in ("_packed", "_packed_key")}


class UnpackedOneDNNLinear(OneDNNLinear):
    """OneDNNLinear on the weight as it lies: no packed copy, for a run that multiplies each weight once
    (the prefill of a run decoding through kept graphs)."""

    packs = False


def weight_stamp(weight: torch.Tensor) -> tuple:
    """What changes when a weight is replaced or edited in place: a packed copy made under another stamp is stale."""
    return weight.data_ptr(), weight.shape, None if weight.is_inference() else weight._version


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's copy of `weight` in the blocked layout its kernels read; batch_size is the row count the layout is
    tuned for: small, as in decoding."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


# weight -> (its stamp when packed, oneDNN's packed copy): held while the weight lives
_PACKED_FOR_GRAPHS = WeakIdKeyDictionary()


def packed_for_graphs(weight: torch.Tensor):
    """oneDNN's packed copy of `weight`, made the first time a compiled step multiplies it (and again if it changed)."""
    entry = _PACKED_FOR_GRAPHS.get(weight)
    if entry is None or entry[0] != weight_stamp(weight):
        entry = _PACKED_FOR_GRAPHS[weight] = (weight_stamp(weight), packed_copy(weight))
    return entry[1]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias by oneDNN on its packed copy of `weight`: a compiled step's matmul over any number of
    rows, which Inductor calls as a library function, `torch.ops.minillm.onednn_linear` (its C++ driver calls back into
    this one)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_for_graphs(weight), bias, "none", [], "")


def _onednn_linear_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# Registered through `torch.library.Library` rather than the `custom_op` decorator, whose wrapper imports
# torch._dynamo at the op's first call (1.2 s, measured in a fresh process's first compiled step).
_LIBRARY = torch.library.Library("minillm", "DEF")
_LIBRARY.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("onednn_linear", onednn_linear, "CPU")
torch.library.register_fake("minillm::onednn_linear", _onednn_linear_shape, lib=_LIBRARY)


class GraphOneDNNLinear(nn.Linear):
    """nn.Linear that a traced graph records as one `onednn_linear` call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.minillm.onednn_linear(x, self.weight, self.bias)


def onednn_packs_float32(model: nn.Module) -> bool:
    """Whether oneDNN can run `model`'s float32 matmuls here: a float32 model on a CPU, with oneDNN built in."""
    parameter = next(model.parameters(), None)
    return (parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def linears_call_onednn(model: nn.Module) -> nn.Module:
    """Every plain nn.Linear of `model` (a graph-ready copy, to be traced) calls `onednn_linear`, in place."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = GraphOneDNNLinear
    return model


@functools.cache
def libraries_stream_matvecs() -> bool:
    """Whether MKL and oneDNN already run a one-row matmul near the memory bandwidth here: an Intel CPU with
    AVX-512 (on the course's Xeon 81-85% of it, against 33-54% on an AMD EPYC with AVX2: lesson 15). There
    MKL's products over one to three rows, on the weight where it lies (in huge pages,
    `minillm.speed.huge_pages`), beat oneDNN's on its packed copy."""
    return cpuinfo_field("vendor_id") == "GenuineIntel" and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def use_onednn(model: nn.Module) -> nn.Module:
    """Swap every plain nn.Linear of `model` for OneDNNLinear, in place; returns the model.

    The swap changes each module's class and nothing else: the same Parameter objects
    stay in place, so tied weights (the LM head and the embedding) stay tied.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
    return model


def use_unpacked_onednn(model: nn.Module) -> nn.Module:
    """Every OneDNNLinear of `model` multiplies its weight as it lies, its packed copy dropped (a one-shot prefill)."""
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.drop_packed_weight()
            module.__class__ = UnpackedOneDNNLinear
    return model


def use_plain_linear(model: nn.Module) -> nn.Module:
    """Undo `use_onednn`: every OneDNNLinear becomes a plain nn.Linear again (the off switch)."""
    for module in model.modules():
        if isinstance(module, OneDNNLinear):
            module.drop_packed_weight()
            module.__class__ = nn.Linear
    return model


def uses_onednn(model: nn.Module) -> bool:
    return any(isinstance(m, OneDNNLinear) for m in model.modules())


__all__ = ["MKL_MAX_ROWS", "GraphOneDNNLinear", "OneDNNLinear", "UnpackedOneDNNLinear", "libraries_stream_matvecs",
           "linears_call_onednn", "onednn_linear", "onednn_packs_float32", "packed_copy", "packed_for_graphs",
           "use_onednn", "use_plain_linear", "use_unpacked_onednn", "uses_onednn", "weight_stamp"]
