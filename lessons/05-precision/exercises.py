"""Lesson 05 exercises: write your answers here; `pytest lessons/05-precision` checks them.

Each function below is a stub. Replace its `raise NotImplementedError` with your answer; the check for that
exercise skips until you do. Worked answers: solutions/05_precision.py (try first!).
"""

from __future__ import annotations


def fp16_round(x):
    """Exercise 1: Round to float16 by hand

    x: a float32 tensor of finite numbers. Return a float32 tensor holding each value rounded to the nearest
    float16, exactly what `x.half().float()` gives, but computed with arithmetic on exponents (no `.half()`,
    no `.to(torch.float16)`):

    - a normal float16 in [2^e, 2^(e+1)) has 10 mantissa bits: the grid step there is 2^(e-10) (`torch.frexp`
      gives e; the smallest normal exponent is -14);
    - below 2^-14 the numbers are subnormal: the step stays 2^-24 (so 2^-25 rounds to 0 and 3 * 2^-25 to 2^-23);
    - round to nearest, ties to even (`torch.round` does ties to even);
    - anything that rounds above 65504 (the largest float16) becomes +-inf: 65519 rounds to 65504, 65520 to inf.
    """
    raise NotImplementedError


def greedy_divergence(model, prompt_ids, max_new_tokens):
    """Exercise 2: Where greedy parts ways

    Greedy-decode `model` (float32) and `with_dtype(model, "bfloat16")` in lock step for up to `max_new_tokens`
    tokens, recomputing the whole sequence each step (`next_token_logits(m, ids)[-1]`, no cache). While they
    agree, both continue from the same sequence.

    Returns None if they choose the same token at every step; otherwise a dict:
      "step": index of the first new token where they differ (0 = the first generated token),
      "float32_token", "bfloat16_token": the two choices (ints),
      "margin": float32's top-1 logit minus its top-2 logit at that step (a float): how close the call was.
    """
    raise NotImplementedError


def bf16_weights_fp32_compute(model):
    """Exercise 3: Round the weights, compute in float32

    Return a copy of `model` that stays float32 but whose matrices, every parameter with 2 or more dimensions
    (the linear weights and the embeddings), hold their values rounded to bfloat16. Parameters with one
    dimension (norm weights, biases) stay exact. The original model must be untouched.

    Its drift from float32 is the part of the bfloat16 model's drift caused by storing the weights in 16
    bits; what the full bfloat16 model adds on top is caused by computing the activations in 16 bits.
    """
    raise NotImplementedError


def largest_activations(model, token_ids):
    """Exercise 4: Float16 headroom

    Run `model` once on the sequence `token_ids` (`next_token_logits` does it) and return a list with one
    float per block: the largest absolute value in the residual stream that block outputs (the tensor
    `model.blocks[i]` returns). Use forward hooks (`module.register_forward_hook`) and remove them afterwards.
    Compare the maximum with float16's 65504 to see the headroom.
    """
    raise NotImplementedError


def copy_into_huge_pages(tensor):
    """Exercise 5: Huge pages by hand

    Return a copy of `tensor` (a contiguous CPU tensor) in memory you map yourself, backed by 2 MiB pages where
    Linux gives them: map private anonymous memory with Python's `mmap` module (`mmap.mmap(-1, size,
    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)`), ask for huge pages with `madvise(mmap.MADV_HUGEPAGE)`, view it
    as a tensor with `torch.frombuffer`, and place the copy so its first byte sits on a 2 MiB boundary (map 2 MiB
    more than you need and skip to the boundary). Same shape, dtype and values; the original untouched.
    """
    raise NotImplementedError

