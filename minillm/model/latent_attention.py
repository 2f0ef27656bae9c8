"""Multi-head latent attention (DeepSeek-V2/V3, lesson 17): every head's keys and values from one small cached latent.

Grouped-query attention shrinks the cache by sharing key/value heads; MLA shrinks it further by
caching, per token and layer, one latent vector c (`kv_lora_rank` wide, 512 in DeepSeek-V3) and
one RoPE key k_rot shared by all heads (`head_dim` wide, 64), instead of a key and a value per head:

    c = norm(W_dkv x)        k_rot = rope(W_kr x)                       <- the cache holds these: 576 numbers
    k_h = [W_uk_h c ; k_rot]    v_h = W_uv_h c                         (W_uk_h, W_uv_h: rows of kv_b_proj)
    q_h = [q_nope_h ; rope(q_rot_h)]   (queries through their own latent when q_lora_rank is set)

Expanding k_h and v_h for every cached token would cost a matmul per step over the whole cache.
Instead the up-projections are absorbed into the query and the output (DeepSeek-V2, section 2.1.3):

    q_h · k_h = (W_uk_hᵀ q_nope_h) · c  +  q_rot_h · k_rot        (a query in the latent's space)
    Σ_j p_j v_h,j = W_uv_h (Σ_j p_j c_j)                          (attention over the latents, then W_uv_h)

so attention runs as multi-query attention (one key head for all query heads) over keys [c ; k_rot],
whose values are the keys' first `kv_lora_rank` dims: the cache stores no values at all
(`ModelConfig.cache_widths`), and every backend and cache of the course serves it unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import SDPABackend
from .norms import RMSNorm
from .rope import apply_rope


class LatentAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.rope_dim, self.nope_dim = config.n_head, config.head_size, config.qk_nope_dim
        self.latent_dim, self.v_dim = config.kv_lora_rank, config.v_head_dim
        query_width = config.n_head * (self.nope_dim + self.rope_dim)
        bias = config.qkv_bias
        if config.q_lora_rank:
            self.q_down = nn.Linear(config.d_model, config.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(config.q_lora_rank, eps=1e-6)
            self.q_up = nn.Linear(config.q_lora_rank, query_width, bias=False)
        else:
            self.q_down, self.q_norm, self.q_up = None, None, nn.Linear(config.d_model, query_width, bias=False)
        self.kv_down = nn.Linear(config.d_model, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_norm = RMSNorm(self.latent_dim, eps=1e-6)
        self.kv_up = nn.Linear(self.latent_dim, config.n_head * (self.nope_dim + self.v_dim), bias=False)
        self.proj = nn.Linear(config.n_head * self.v_dim, config.d_model, bias=bias)
        # The backend divides scores by √(width of its queries), latent_dim + rope_dim; the model's own scale is
        # 1/√query_pre_attn_scalar (DeepSeek: (nope + rope) dims, YaRN's temperature folded in).
        scalar = config.query_pre_attn_scalar or self.nope_dim + self.rope_dim
        self.q_scale = math.sqrt((self.latent_dim + self.rope_dim) / scalar)
        self.backend = SDPABackend()

    def forward(self, x, rope, layer, cache, step):
        B, T, _ = x.shape
        H, latent = self.n_head, self.latent_dim
        q = self.q_up(self.q_norm(self.q_down(x)) if self.q_down is not None else x)
        q_nope, q_rot = q.view(B, T, H, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rot = self.kv_down(x).split([latent, self.rope_dim], dim=-1)
        rotated = apply_rope(torch.cat((q_rot, k_rot[:, :, None]), dim=2), *rope)  # [B, T, H + 1, rope]
        w_uk, w_uv = self.kv_up.weight.view(H, self.nope_dim + self.v_dim, latent).split([self.nope_dim, self.v_dim],
                                                                                        dim=1)
        q_latent = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # [B, H, T, latent]: W_uk_hᵀ q_nope_h
        query = torch.cat((q_latent, rotated[:, :, :H].transpose(1, 2)), dim=-1) * self.q_scale
        key = torch.cat((self.kv_norm(c), rotated[:, :, H]), dim=-1)[:, None]  # [B, 1, T, latent + rope]
        if cache is not None:
            key, _ = cache.update(layer, key, key[..., :0])  # the values are the keys' latent part: none stored
        y = self.backend(query, key, key[..., :latent], step)  # [B, H, T, latent]: attention over the latents
        out = torch.einsum("bhtc,hvc->bthv", y, w_uv)  # W_uv_h applied after attention
        return self.proj(out.reshape(B, T, H * self.v_dim))


__all__ = ["LatentAttention"]
