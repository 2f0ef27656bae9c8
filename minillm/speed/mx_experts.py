"""A mixture of experts' experts kept in MXFP4, as gpt-oss ships them: 4.25 bits a weight, decoded only when picked.

gpt-oss stores its expert matrices, almost all of its parameters, in OCP MXFP4 (lesson 14:
blocks of 32 E2M1 elements sharing one E8M0 scale) and everything else in bfloat16. Here
`experts_in_mxfp4` does the same to any mixture of experts the course loads: each layer's
stacked gate/up and down matrices are encoded with lesson 14's `mx_encode`, two elements to a
byte (`pack_fp4`), and the float copies dropped. A step decodes only the experts its tokens
picked (`mx_decode`), so the memory the experts take falls about 7.5-fold (32 bits to 4.25)
while the work per token stays that of k experts, plus their decode.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.experts import MoE
from .mx import BLOCK_SIZE, mx_decode, mx_encode, pack_fp4, unpack_fp4
from .quant import QuantizationError


class MXFP4Experts(nn.Module):
    """Every expert's two matrices as packed E2M1 codes and E8M0 scales; called with e, returns them decoded."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.dtype = gate_up.dtype
        for name, matrices in (("gate_up", gate_up), ("down", down)):
            codes, scales = mx_encode(matrices.detach().float(), "mxfp4")  # [E, rows, K], [E, rows, K/32]
            self.register_buffer(f"{name}_codes", pack_fp4(codes))  # [E, rows, K/2]: two elements a byte
            self.register_buffer(f"{name}_scales", scales)

    def forward(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(mx_decode(unpack_fp4(getattr(self, f"{name}_codes")[e]), getattr(self, f"{name}_scales")[e],
                               "mxfp4").to(self.dtype) for name in ("gate_up", "down"))

    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def experts_in_mxfp4(model: nn.Module) -> nn.Module:
    """Keep every mixture-of-experts layer's experts in MXFP4 (in place; the router, attention and the rest stay as
    they are); returns the model. Refuses, before changing anything, a model without experts or with an expert
    matrix whose rows are not a whole number of 32-element blocks."""
    layers = [module for module in model.modules() if isinstance(module, MoE)]
    if not layers:
        raise QuantizationError("--quant mxfp4 keeps a mixture of experts' experts in MXFP4, and this model has no "
                                "experts: use --quant int8, int4 or gguf")
    for moe in layers:
        for name in ("gate_up", "down"):
            if getattr(moe, name).shape[-1] % BLOCK_SIZE:
                raise QuantizationError(f"--quant mxfp4: the experts' {name} rows hold {getattr(moe, name).shape[-1]} "
                                        f"weights, not a multiple of MXFP4's block of {BLOCK_SIZE}")
    for moe in layers:
        moe.packed = MXFP4Experts(moe.gate_up, moe.down)
        del moe.gate_up, moe.down  # the float copies go: what the experts take is now the packed bytes
    return model


__all__ = ["MXFP4Experts", "experts_in_mxfp4"]
