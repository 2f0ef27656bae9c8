"""Checks for lesson 16's exercises: `pytest lessons/16-attention-kernels` (yours) or `--solutions`.

References: PyTorch's SDPA and `torch.logsumexp` on the masked scores, a brute-force scan of the causal mask,
and softmax attention over keys gathered from the pool.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def lower_right(T: int, S: int) -> torch.Tensor:
    return torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)


def reference(q, k, v, mask):
    """(out, lse) for one head: SDPA and the log-sum-exp of the masked scores."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
    scores = (q @ k.T / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(scores, dim=-1)


def assert_attention(out, lse, expected_out, expected_lse):
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(lse == float("-inf"), expected_lse == float("-inf"))
    finite = expected_lse > float("-inf")
    torch.testing.assert_close(lse[finite], expected_lse[finite], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ Exercise 1


def test_exercise_1_merging_two_key_sets_equals_attention_over_both(answers):
    gen = torch.Generator().manual_seed(0)
    T, S, hd = 6, 20, 8
    q, k, v = torch.randn(T, hd, generator=gen), torch.randn(S, hd, generator=gen), torch.randn(S, hd, generator=gen)
    for trial in range(12):
        mask = torch.rand(T, S, generator=gen) < 0.5
        mask[0] = False  # a query that sees nothing at all
        mask[1, : S // 2] = False  # one that sees nothing of the first half
        split = int(torch.randint(0, S + 1, (), generator=gen)) if trial else S // 2
        a = reference(q, k[:split], v[:split], mask[:, :split])
        b = reference(q, k[split:], v[split:], mask[:, split:])
        out, lse = answers.merge_attention(*a, *b)
        assert_attention(out, lse, *reference(q, k, v, mask))


# ------------------------------------------------------------------ Exercise 2


@pytest.mark.parametrize("T, S", [(1, 1), (1, 33), (7, 7), (37, 37), (11, 40), (64, 64)])
def test_exercise_2_tiled_attention_equals_sdpa(answers, T, S):
    gen = torch.Generator().manual_seed(T * 100 + S)
    q, k, v = torch.randn(T, 16, generator=gen), torch.randn(S, 16, generator=gen), torch.randn(S, 16, generator=gen)
    expected = reference(q, k, v, lower_right(T, S))
    for block_q, block_k in ((1, 1), (5, 7), (16, 3), (64, 64)):
        out, lse = answers.tiled_attention(q, k, v, block_q, block_k)
        assert out.shape == (T, 16) and lse.shape == (T,), (block_q, block_k)
        assert_attention(out, lse, *expected)


# ------------------------------------------------------------------ Exercise 3


def brute_force_tiles(T, S, block_q, block_k):
    mask = lower_right(T, S)
    tiles = sorted({(i // block_q, j // block_k) for i, j in mask.nonzero().tolist()})
    covered = sum((min(T, (i + 1) * block_q) - i * block_q) * (min(S, (j + 1) * block_k) - j * block_k)
                  for i, j in tiles)
    return tiles, covered / (T * S)


def test_exercise_3_tiles_match_a_brute_force_scan(answers):
    tiles, share = answers.causal_tiles(4, 4, 2, 2)
    assert list(tiles) == [(0, 0), (1, 0), (1, 1)] and share == pytest.approx(0.75)
    for T, S, block_q, block_k in [(1, 50, 16, 16), (37, 37, 5, 7), (11, 40, 4, 4), (64, 64, 16, 16),
                                   (100, 100, 8, 32), (9, 9, 1, 1), (13, 30, 64, 64)]:
        tiles, share = answers.causal_tiles(T, S, block_q, block_k)
        expected_tiles, expected_share = brute_force_tiles(T, S, block_q, block_k)
        assert [tuple(t) for t in tiles] == expected_tiles, (T, S, block_q, block_k)
        assert share == pytest.approx(expected_share), (T, S, block_q, block_k)


# ------------------------------------------------------------------ Exercise 4


def test_exercise_4_paged_decode_equals_attention_over_the_gathered_keys(answers):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hd = 12, 4, 16
    k_pool = torch.randn(num_blocks, block_size, hd, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, hd, generator=gen)
    for length in (1, 3, 4, 5, 13, 24):
        table = torch.randperm(num_blocks, generator=gen)[: -(-length // block_size)].tolist()
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        k, v = k_pool.flatten(0, 1)[slots], v_pool.flatten(0, 1)[slots]
        q = torch.randn(hd, generator=gen)
        expected = torch.softmax(k @ q / hd ** 0.5, dim=0) @ v
        out = answers.paged_decode(q, k_pool, v_pool, table, length)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"length {length}: {m}")


# ------------------------------------------------------------------ Exercise 5


def tiles_of(scores, size):
    """A one-pass iterator over the tiles (it cannot be rewound)."""
    return (scores[i: i + size] for i in range(0, len(scores), size))


def test_exercise_5_online_softmax_equals_torch_softmax(answers):
    gen = torch.Generator().manual_seed(5)
    for n, size, spread in [(1, 1, 1.0), (7, 3, 1.0), (100, 16, 30.0), (1000, 64, 100.0), (257, 1, 5.0)]:
        scores = torch.randn(n, generator=gen) * spread
        scores[torch.rand(n, generator=gen) < 0.2] = float("-inf")  # masked keys
        scores[: min(size, n - 1)] = float("-inf")  # a first tile that sees nothing
        scores[-1] = scores[-1] if scores[-1] > float("-inf") else 0.0  # at least one visible key
        m, l = answers.online_softmax(tiles_of(scores, size))
        assert m.dtype == l.dtype == torch.float32 and m.shape == l.shape == ()
        assert m == scores.max(), "m must be the maximum itself, not an estimate of it"
        probs = torch.exp(scores - m) / l
        torch.testing.assert_close(probs, torch.softmax(scores, dim=0), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m + torch.log(l), torch.logsumexp(scores, dim=0), rtol=1e-6, atol=1e-6)
    m, l = answers.online_softmax(tiles_of(torch.full((10,), float("-inf")), 4))  # nothing visible at all
    assert m == float("-inf") and l == 0 and not (m.isnan() or l.isnan())


# ------------------------------------------------------------------ Exercise 6


def test_exercise_6_costs_are_the_benchmarks(answers):
    from minillm.bench.attention import attention_cost

    assert answers.attention_cost("naive", 4, 4, 1, 1, 2)["flops"] == 4 * 16 * 2  # 16 pairs, 2 mul-adds of hd = 2
    for T, S in [(1, 1), (1, 8192), (64, 64), (100, 100), (37, 300), (512, 512), (4096, 4096)]:
        for H, KV, hd in [(9, 3, 64), (12, 12, 64), (8, 1, 128)]:
            for block_q in (16, 64):
                for kind in ("naive", "flash"):
                    expected = attention_cost(kind, T, S, H, KV, hd, block_q=block_q, element=2)
                    got = answers.attention_cost(kind, T, S, H, KV, hd, block_q=block_q, element=2)
                    assert got == expected, (kind, T, S, H, KV, hd, block_q)
    with pytest.raises(ValueError):
        answers.attention_cost("sdpa", 4, 4, 1, 1, 2)
