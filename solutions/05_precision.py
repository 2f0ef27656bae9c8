"""Worked solutions for lesson 05 (precision). Check them: `pytest lessons/05-precision --solutions`."""

from __future__ import annotations

import copy
import mmap

import torch

from minillm.speed.precision import next_token_logits, with_dtype


def fp16_round(x):
    """Exercise 1: Round to float16 by hand"""
    x = x.float()
    # frexp: x = mantissa * 2^exponent with 0.5 <= |mantissa| < 1, so |x| lies in [2^(exponent-1), 2^exponent).
    _, exponent = torch.frexp(x)
    e = (exponent - 1).clamp(min=-14)  # float16's smallest normal exponent; below it the step stays 2^-24
    step = torch.pow(2.0, (e - 10).float())  # 10 mantissa bits: 2^10 values per power of two
    rounded = torch.round(x / step) * step  # x / step is exact (a power of two); round() ties to even
    # A value that rounds past the largest float16 (65504) overflows. 65520 is a tie between 65504 and 65536
    # and ties go to the even mantissa, 65536: not representable, so inf.
    return torch.where(rounded.abs() > 65504, torch.copysign(torch.tensor(float("inf")), x), rounded)


@torch.inference_mode()
def greedy_divergence(model, prompt_ids, max_new_tokens):
    """Exercise 2: Where greedy parts ways"""
    low = with_dtype(model, "bfloat16")
    sequence = list(prompt_ids)
    for step in range(max_new_tokens):
        reference = next_token_logits(model, sequence)[-1]  # float32 [vocab]
        other = next_token_logits(low, sequence)[-1]  # float32 tensor of bfloat16 values
        a, b = int(reference.argmax()), int(other.argmax())
        if a != b:
            top2 = reference.topk(2).values
            return {"step": step, "float32_token": a, "bfloat16_token": b, "margin": float(top2[0] - top2[1])}
        sequence.append(a)  # they agree: both continue from the same text
    return None


def bf16_weights_fp32_compute(model):
    """Exercise 3: Round the weights, compute in float32"""
    copied = copy.deepcopy(model)  # never touch the caller's model
    with torch.no_grad():
        for parameter in copied.parameters():  # a tied matrix is one Parameter: rounded once
            if parameter.dim() >= 2:
                # Round to bfloat16 and back: float32 storage, bfloat16 values.
                parameter.copy_(parameter.to(torch.bfloat16).float())
    return copied


def largest_activations(model, token_ids):
    """Exercise 4: Float16 headroom"""
    largest = [0.0] * len(model.blocks)

    def recorder(i):
        def hook(module, inputs, output):  # output: the residual stream after block i, [B, T, d_model]
            largest[i] = max(largest[i], float(output.abs().max()))
        return hook

    handles = [block.register_forward_hook(recorder(i)) for i, block in enumerate(model.blocks)]
    try:
        next_token_logits(model, token_ids)
    finally:
        for handle in handles:  # leave the model as we found it
            handle.remove()
    return largest


def copy_into_huge_pages(tensor):
    """Exercise 5: Huge pages by hand"""
    huge_page = 2 << 20
    nbytes = tensor.numel() * tensor.element_size()
    region = mmap.mmap(-1, nbytes + huge_page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # a request: the kernel backs the region with 2 MiB pages if it can
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    skip = -address % huge_page  # bytes from the mapping's start to the next 2 MiB boundary
    # frombuffer's tensor keeps `region` alive; its bytes reinterpreted as the tensor's dtype and shape.
    copied = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=skip)
    copied = copied.view(tensor.dtype).view(tensor.shape)
    copied.copy_(tensor)  # the first write to each page faults it in: as a huge page, where it was granted
    return copied

