"""Checks for lesson 17's exercises: `pytest lessons/17-model-families` (yours) or `--solutions`.

References: minillm's and transformers' norms, a brute-force mask and transformers' MistralForCausalLM,
`minillm.model.weight_names.rotary_order` and GPT-J's own rotation of neighbouring pairs.
"""

from __future__ import annotations

import pytest
import torch

from minillm.model.config import ModelConfig
from minillm.model.norms import GemmaRMSNorm
from minillm.model.rope import RopeTable, apply_rope
from minillm.model.tiny import TINY_WINDOW, tiny_pair
from minillm.model.weight_names import rotary_order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exercise_1_gemma_norm_equals_minillm_and_transformers(answers, dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 4).to(dtype)
    ours, theirs = GemmaRMSNorm(64, 1e-6), Gemma3RMSNorm(64, 1e-6)
    with torch.no_grad():
        ours.weight.uniform_(-0.5, 0.5)
        theirs.weight.copy_(ours.weight)
        got = answers.gemma_rms_norm(x, ours.weight.to(dtype), 1e-6)
        assert got.dtype == dtype
        assert torch.equal(got, ours.to(dtype)(x)) and torch.equal(got, theirs.to(dtype)(x))


def brute_force_window(positions, num_keys, window):
    B, T = positions.shape
    mask = torch.zeros(B, T, num_keys, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for j in range(num_keys):
                mask[b, t, j] = 0 <= int(positions[b, t]) - j < window
    return mask


def test_exercise_2_mask_by_brute_force(answers):
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15, 16]])
    for window in (1, 3, 8):
        got = answers.sliding_window_mask(positions, 17, window)
        assert got.dtype == torch.bool and torch.equal(got, brute_force_window(positions, 17, window)), window


def test_exercise_2_mask_gives_transformers_mistral(answers):
    hf_model, model = tiny_pair("mistral")
    length = 3 * TINY_WINDOW
    tokens = torch.randint(0, 96, (1, length), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(length)[None]
    mask = answers.sliding_window_mask(positions, length, TINY_WINDOW)
    for block in model.blocks:  # hand the window-free attention your mask instead of the package's
        block.attn.window = None
    with torch.no_grad():
        got = model(tokens, positions, mask=mask)
        torch.testing.assert_close(got, hf_model(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim, rotary_dim", [(8, 8), (8, 4), (16, 6), (64, 32)])
def test_exercise_3_order_matches_the_package_and_keeps_scores(answers, head_dim, rotary_dim):
    order = torch.as_tensor(answers.interleaved_to_halves(head_dim, rotary_dim))
    assert torch.equal(order, rotary_order(head_dim, rotary_dim, interleaved=True))
    torch.manual_seed(1)
    q, k = torch.randn(1, 6, 2, head_dim), torch.randn(1, 6, 2, head_dim)
    positions = torch.arange(6)[None]

    def gptj_rotate(x):  # GPT-J: neighbours (2i, 2i + 1) of the first rotary_dim dims, speed theta^(-2i/rotary_dim)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        angles = positions[0, :, None].float() * inv_freq  # [T, rotary_dim/2]
        sin, cos = angles.sin().repeat_interleave(2, -1)[:, None], angles.cos().repeat_interleave(2, -1)[:, None]
        rot = x[..., :rotary_dim]
        pairs = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
        return torch.cat((rot * cos + pairs * sin, x[..., rotary_dim:]), dim=-1)

    table = RopeTable(ModelConfig(n_head=2, d_model=2 * head_dim, positions="rope", norm="rmsnorm", mlp="swiglu",
                                  rotary_dim=rotary_dim))
    rope = table(positions, torch.float32)
    ours = apply_rope(q[..., order], *rope) @ apply_rope(k[..., order], *rope).transpose(-1, -2)
    theirs = gptj_rotate(q) @ gptj_rotate(k).transpose(-1, -2)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
