"""gpt-oss's expert matrices as its released checkpoints store them, in MXFP4, decoded to float when loaded.

A gpt-oss checkpoint keeps each expert matrix as two tensors (OCP MX v1.0's MXFP4, lesson 14):

    <name>_blocks   uint8 [E, rows, K/32, 16]   32 E2M1 codes per block, two to a byte: element 2i in the low
                                                nibble of byte i, element 2i + 1 in the high one
    <name>_scales   uint8 [E, rows, K/32]       each block's E8M0 scale: 2^(s − 127)

An E2M1 code is a sign bit and three magnitude bits that index the format's eight values. Loading turns them
into float weights, as transformers does on a CPU; `--quant mxfp4` (`minillm.speed.mx_experts`) keeps a model's
experts in MXFP4 again. Every value decoded here is one lesson 14's encoder stores exactly (a block whose largest
code is below 4 gets a smaller scale and doubled codes, the same values), so nothing is lost on the way back but
for scales within a few powers of two of E8M0's smallest.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; codes 8-15 are their negatives
SCALE_BIAS = 127


def mxfp4_to_float(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., K/32, 16], scales uint8 [..., K/32] -> float32 [..., K]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit: blocks "
                         f"hold 16 bytes for each scale")
    values = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., K/32, 32]
    one = torch.ones_like(scales, dtype=torch.float32)
    scale = torch.ldexp(one, scales.to(torch.int32) - SCALE_BIAS)  # [..., K/32]
    return (values[codes] * scale[..., None]).flatten(-2)


__all__ = ["mxfp4_to_float"]
