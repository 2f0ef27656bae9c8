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

The products are the same dot products summed in another order: results differ from
`F.linear` by float32 rounding, as any two BLAS libraries do. Everything else (GPUs,
bf16/fp16, training, a PyTorch without oneDNN) falls back to plain `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..base.machine import cpuinfo_field

MKL_MAX_ROWS = 3  # activation rows up to which MKL's product beats oneDNN's where `libraries_stream_matvecs`


class OneDNNLinear(nn.Linear):
    """nn.Linear whose float32 CPU inference matmul runs oneDNN on a prepacked weight."""

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
        key = (w.data_ptr(), w.shape, None if w.is_inference() else w._version)
        if getattr(self, "_packed_key", None) != key:
            # batch_size is the row count the layout is tuned for: small, as in decoding.
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
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


def use_plain_linear(model: nn.Module) -> nn.Module:
    """Undo `use_onednn`: every OneDNNLinear becomes a plain nn.Linear again (the off switch)."""
    for module in model.modules():
        if type(module) is OneDNNLinear:
            module.drop_packed_weight()
            module.__class__ = nn.Linear
    return model


def uses_onednn(model: nn.Module) -> bool:
    return any(type(m) is OneDNNLinear for m in model.modules())


__all__ = ["MKL_MAX_ROWS", "OneDNNLinear", "libraries_stream_matvecs", "use_onednn", "use_plain_linear", "uses_onednn"]
