"""Quantizing a whole model: swap each of its nn.Linears for a quantized linear, and back (lesson 14).

The swaps happen after loading (gpt-fast's pattern, like `minillm.speed.onednn`): `model.py`
stays plain, and `dequantize_model` is the off switch that turns every quantized linear back
into an `nn.Linear` holding the weight the quantized one stands for (the reference every swap
is checked against). The linears themselves and their kernels' limits live in
`minillm.speed.quant`; here is what a model needs around them: every linear checked before
any is replaced, static int8's activation scales read off sample text
(`calibrate_input_ranges`), and the bytes a decode step then reads (`weight_bytes`).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from .quant import (
    DynamicInt8Linear,
    Int4WeightLinear,
    Int8WeightLinear,
    QuantizationError,
    QuantizedLinear,
    StaticInt8Linear,
    check_device,
    check_int4_dtype,
    check_int4_shape,
    check_int8_shape,
)

METHODS = ("int8", "int4", "dynamic-int8", "static-int8")


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every nn.Linear (or subclass, such as OneDNNLinear) of the model, by qualified name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@torch.no_grad()
def calibrate_input_ranges(model: nn.Module, calibration_tokens: torch.Tensor) -> dict[str, float]:
    """max |input| seen by each linear while the model reads `calibration_tokens` [B, T] (static int8's scales)."""
    ranges, hooks = {}, []
    for name, linear in linears(model):
        def record(module, args, name=name):
            ranges[name] = max(ranges.get(name, 0.0), args[0].detach().abs().max().item())
        hooks.append(linear.register_forward_pre_hook(record))
    try:
        b, t = calibration_tokens.shape
        model(calibration_tokens, torch.arange(t).expand(b, t))
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = 32, compute_dtype=torch.bfloat16,
                   calibration_tokens: torch.Tensor | None = None, head: str | None = None) -> nn.Module:
    """Swap every nn.Linear of `model` for its quantized form, in place; returns the model.

    method: "int8" / "int4" (weight-only, computing in `compute_dtype`), "dynamic-int8", or
    "static-int8" (needs `calibration_tokens` [B, T]: text the model reads once to fix each
    activation scale). Every linear is checked before any is replaced, so a refusal leaves
    the model as it was. The tied embedding keeps its float weight: a token's lookup reads
    one row, while the LM head reads the whole matrix every step, so only the head is quantized.
    `head` stores the LM head another way: "int8" (as llama.cpp's 4-bit files keep their
    output matrix at 6-8 bits: the logits are what every token is picked from) or "none"
    (kept float); None quantizes it like the rest.
    """
    for name, value, allowed in (("quantization", method, METHODS), ("head", head, (None, "int8", "int4", "none"))):
        if value not in allowed:
            raise QuantizationError(f"unknown {name} {value!r}: use one of {', '.join(map(str, allowed))}")
    targets = [(name, linear, method if name != "lm_head" or head is None else head)
               for name, linear in linears(model) if not (name == "lm_head" and head == "none")]
    for name, linear, how in targets:
        check_device(linear, name, how)
        if how == "int4":
            check_int4_shape(linear.out_features, linear.in_features, group_size, name)
            check_int4_dtype(linear.weight.device, compute_dtype)
        elif how == "int8":
            check_int8_shape(linear.in_features, compute_dtype, name)
    if method == "static-int8":
        if calibration_tokens is None:
            raise QuantizationError("static-int8 needs calibration_tokens: a [B, T] batch of sample text token ids")
        ranges = calibrate_input_ranges(model, calibration_tokens)
    for name, linear, how in tqdm(targets, desc=f"quantizing to {method}", unit="linear", leave=False):
        if how == "int8":
            new = Int8WeightLinear.from_linear(linear, compute_dtype)
        elif how == "int4":
            new = Int4WeightLinear.from_linear(linear, group_size, compute_dtype)
        elif how == "dynamic-int8":
            new = DynamicInt8Linear.from_linear(linear)
        else:
            new = StaticInt8Linear.from_linear(linear, ranges[name])
        replace_module(model, name, new)
    return model


@torch.no_grad()
def dequantize_model(model: nn.Module) -> nn.Module:
    """The off switch and the reference: each quantized linear becomes an nn.Linear holding its dequantized weight.

    The result computes with the very weights the quantized model stands for, in plain
    float32 `F.linear`: any difference left is the kernels' (and the activations' rounding).
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight.data = module.dequantized_weight()
            if module.bias is not None:
                plain.bias.data = module.bias.detach().float().clone()
            replace_module(model, name, plain.to(next(model.parameters()).dtype))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: quantized linears' codes and scales, the rest of the
    parameters, and one row of the embedding (a lookup) unless the head shares it unquantized."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    total = sum(m.weight_bytes() for m in quantized)
    seen = {id(p) for m in quantized for p in m.parameters()}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        shared_with_head = isinstance(getattr(model, "lm_head", None), nn.Linear) and p is model.lm_head.weight
        if p is getattr(getattr(model, "tok_emb", None), "weight", None) and not shared_with_head:
            total += p.shape[1] * p.element_size()  # a lookup reads one row
        else:
            total += p.numel() * p.element_size()
    return total


def quantized_modules(model: nn.Module) -> dict[str, int]:
    """How many linears of each quantized kind the model holds (a quick look at what a swap did)."""
    counts = {}
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return counts


__all__ = ["METHODS", "calibrate_input_ranges", "quantize_model", "dequantize_model", "weight_bytes",
           "quantized_modules", "replace_module", "linears"]
