"""Worked answers to lesson 17's exercises (`pytest lessons/17-model-families --solutions` checks them)."""

from __future__ import annotations

import torch


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exercise 1: Gemma's norm by hand"""
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normalized * (1.0 + weight.float())).to(x.dtype)  # scale in float32, cast last


def sliding_window_mask(positions: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """Exercise 2: The sliding-window mask"""
    columns = torch.arange(num_keys)  # key j sits at column j, which is its position
    delta = positions[:, :, None] - columns  # [B, T, S]: how far back each key lies
    return (delta >= 0) & (delta < window)


def interleaved_to_halves(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Exercise 3: From neighbours to halves"""
    still = (head_dim - rotary_dim) // 2
    evens, odds = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    passing = torch.arange(rotary_dim, head_dim)
    return torch.cat((evens, passing[:still], odds, passing[still:]))
