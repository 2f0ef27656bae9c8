"""Checks for lesson 16's exercises: `pytest lessons/16-attention-kernels` (yours) or `--solutions`.

References: PyTorch's SDPA and `torch.logsumexp` on the masked scores, float64 softmax attention and a metered
score function that records every tile computed, a brute-force scan of the sliding-window mask, softmax attention
over keys gathered from the pool, the broken online sum from its definition, and the benchmark's cost accounting.
"""

from __future__ import annotations

import sys

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
    assert not out.isnan().any() and not lse.isnan().any(), "NaN: did a row whose maximum is still -inf subtract -inf?"
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


class MeteredScores:
    """The only way to the scores: score(q0, q1, k0, k1) is the tile q[q0:q1] k[k0:k1]ᵀ / √hd, and every call is
    recorded, so a loop that computes a tile it could have skipped is caught by its calls, not by its output."""

    def __init__(self, q, k):
        self.q, self.k, self.calls = q, k, []

    def __call__(self, q0, q1, k0, k1):
        q0, q1, k0, k1 = int(q0), int(q1), int(k0), int(k1)
        assert 0 <= q0 < q1 <= len(self.q) and 0 <= k0 < k1 <= len(self.k), f"no such tile {(q0, q1, k0, k1)}"
        self.calls.append((q0, q1, k0, k1))
        return self.q[q0:q1] @ self.k[k0:k1].T / self.q.shape[-1] ** 0.5


def exact_attention(q, k, v, mask):
    """(out, lse) in float64 from the definition: softmax over the visible keys; zeros and -inf for a row with none."""
    scores = (q.double() @ k.double().T / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[:, None])  # an empty row: exp(-inf) = 0
    return (p @ v.double()).float(), lse.float()


def tiles_to_compute(mask, block_q, block_k):
    """Every tile of the grid in which the mask holds a True: what a kernel must compute, and nothing else."""
    T, S = mask.shape
    return sorted((q0, min(q0 + block_q, T), k0, min(k0 + block_k, S)) for q0 in range(0, T, block_q)
                  for k0 in range(0, S, block_k) if mask[q0:q0 + block_q, k0:k0 + block_k].any())


def padded_causal(T, S, pad):
    """Lower-right causal with the first `pad` keys padding; the queries at those positions see nothing."""
    keys = torch.arange(S) >= pad
    return lower_right(T, S) & keys[None, :] & keys[S - T:, None]


def masks_for_exercise_2():
    """Masks the notebook's causal loop never meets: each empties some tiles, or some rows inside a computed tile."""
    gen = torch.Generator().manual_seed(2)
    band = lower_right(24, 24)
    band[:, 8:16] = False  # keys 8 .. 15 masked for every query: below the diagonal, and still empty tiles
    late_row = lower_right(8, 20)
    late_row[2, :12] = False  # one row's first visible key lies tiles after its neighbours'
    return {
        "padding, first key tile empty": padded_causal(13, 13, 5),
        "decode after padding": padded_causal(1, 33, 10),
        "a band masked for everyone": band,
        "a row that starts late": late_row,
        "causal chunk after a prefix": lower_right(11, 40),
        "random and sparse": torch.rand(30, 30, generator=gen) < 0.12,
        "nothing visible": torch.zeros(6, 9, dtype=torch.bool),
    }


@pytest.mark.parametrize("name", list(masks_for_exercise_2()))
def test_exercise_2_tiled_attention_skips_every_empty_tile(answers, name):
    mask = masks_for_exercise_2()[name]
    T, S = mask.shape
    gen = torch.Generator().manual_seed(T * 100 + S)
    q, k, v = torch.randn(T, 16, generator=gen), torch.randn(S, 16, generator=gen), torch.randn(S, 16, generator=gen)
    expected = exact_attention(q, k, v, mask)
    for block_q, block_k in ((1, 1), (4, 4), (5, 7), (16, 3), (64, 64)):
        score = MeteredScores(q, k)
        out, lse = answers.tiled_attention(score, v, mask, block_q, block_k)
        assert out.shape == (T, 16) and lse.shape == (T,), (block_q, block_k)
        assert_attention(out, lse, *expected)
        needed = tiles_to_compute(mask, block_q, block_k)
        extra = sorted(set(score.calls) - set(needed))
        assert not extra, (f"{name}, tiles {block_q}x{block_k}: computed {len(extra)} tiles the mask leaves empty, "
                           f"e.g. (q0, q1, k0, k1) = {extra[0]}")
        assert sorted(score.calls) == needed, (
            f"{name}, tiles {block_q}x{block_k}: call score once per tile that holds a visible pair "
            f"({len(needed)} tiles), not {len(score.calls)} times")


# ------------------------------------------------------------------ Exercise 3


def brute_force_window_tiles(L, B, W):
    """Scan the [L, L] mask: pad it to whole tiles, and count the tiles holding a True."""
    i = torch.arange(L)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)  # [L, L]: query i sees key j
    n = -(-L // B)
    padded = torch.zeros(n * B, n * B, dtype=torch.bool)
    padded[:L, :L] = mask
    return int(padded.view(n, B, n, B).any(dim=3).any(dim=1).sum())


LINE_BUDGET = 10_000  # Python lines a closed form runs in; a loop over 10**16 tiles would run for years


def without_a_loop(function, *args):
    """Call function(*args), failing once it has executed LINE_BUDGET Python lines: a loop over tiles fails here,
    deterministically (a count, not a clock), instead of hanging the check."""
    executed = 0

    def count(frame, event, arg):
        nonlocal executed
        if event == "line":
            executed += 1
            if executed > LINE_BUDGET:
                raise RuntimeError(f"window_tiles{args} ran over {LINE_BUDGET} lines of Python: derive a closed "
                                   "form, do not loop over tiles")
        return count

    previous = sys.gettrace()
    sys.settrace(count)
    try:
        return function(*args)
    finally:
        sys.settrace(previous)


def test_exercise_3_window_tiles_match_a_brute_force_scan(answers):
    assert answers.window_tiles(16, 4, 16) == 10  # W >= L: the notebook's causal picture, 10 of 16 tiles
    for L in range(1, 41):
        for B in (1, 2, 3, 4, 5, 8, 16, 64):
            for W in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 40, 100):
                expected = brute_force_window_tiles(L, B, W)
                got = answers.window_tiles(L, B, W)
                assert got == expected, f"L={L}, B={B}, W={W}: {expected} tiles hold a visible pair, you said {got}"
    assert answers.window_tiles(4096, 128, 512) == brute_force_window_tiles(4096, 128, 512)  # Gemma 3's window


def test_exercise_3_window_tiles_at_an_enormous_length(answers):
    """Past a few windows every further query tile adds the same number of tiles, so the count at L = 10**18 is the
    brute-force count at a short L of the same remainder mod B plus that step times the number of tiles between."""
    answers.window_tiles(1, 1, 1)  # skips here, before the scans below, while window_tiles is a stub
    for L, B, W in [(10**18 + 7, 64, 4096), (10**18, 128, 512), (3 * 10**17 + 1, 1, 3), (10**18 - 1, 7, 1000)]:
        short = L % B + B * (-(-(W + 2 * B) // B))  # same remainder, past the first window and a tile
        counts = [brute_force_window_tiles(short + s * B, B, W) for s in range(3)]
        step = counts[1] - counts[0]
        assert counts[2] - counts[1] == step  # the reference's own premise: a steady step
        expected = counts[0] + step * ((L - short) // B)
        got = without_a_loop(answers.window_tiles, L, B, W)
        assert isinstance(got, int) and got == expected, f"L={L}, B={B}, W={W}: expected {expected}, got {got}"


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


def broken_normalizer(scores, size):
    """l without the rescale, from its definition, in float64: each tile's Σ exp(s - m_t), m_t being the maximum of
    every score up to the end of that tile (recomputed from scratch, not carried); a tile with m_t = -inf adds 0."""
    scores = scores.double()
    total = torch.tensor(0.0, dtype=torch.float64)
    for end in range(size, len(scores) + size, size):
        m_t = scores[:end].max()
        if m_t > float("-inf"):
            total = total + torch.exp(scores[end - size: end] - m_t).sum()
    return total


def test_exercise_5_online_softmax_without_rescale_is_the_broken_sum(answers):
    gen = torch.Generator().manual_seed(5)
    for n, size, spread in [(4, 1, 1.0), (7, 3, 1.0), (100, 16, 3.0), (1000, 64, 5.0), (257, 1, 2.0)]:
        scores = torch.randn(n, generator=gen) * spread
        scores[torch.rand(n, generator=gen) < 0.2] = float("-inf")  # masked keys
        scores[: min(size, n - 1)] = float("-inf")  # a first tile that sees nothing
        scores[min(size, n - 2)] = 0.0  # a finite score in the second tile ...
        scores[-1] = scores[-1].abs() + 3 * spread  # ... and the maximum last: m grows after finite tiles
        m, l = answers.online_softmax_without_rescale(tiles_of(scores, size))
        assert m.dtype == l.dtype == torch.float32 and m.shape == l.shape == ()
        assert m == scores.max(), "m is not what the bug breaks: it must still be the exact maximum"
        assert not l.isnan(), f"n={n}, tiles of {size}: l is NaN (a tile that sees nothing must add nothing)"
        true_l = torch.exp(scores.double() - scores.max()).sum()
        expected = broken_normalizer(scores, size)
        assert expected > true_l * 1.01  # the row does exercise the bug
        torch.testing.assert_close(l.double(), expected, rtol=1e-5, atol=0,
                                   msg=lambda message: f"n={n}, tiles of {size}: {message} (did you keep the rescale?)")
    m, l = answers.online_softmax_without_rescale(tiles_of(torch.full((10,), float("-inf")), 4))  # nothing visible
    assert m == float("-inf") and l == 0 and not (m.isnan() or l.isnan())


PREDICTION_ROWS = {  # name: (scores, tile size), as listed in the stub's docstring
    "largest first": ([4.0, 1.0, 3.0, 0.0], 2),
    "rising": ([0.0, 1.0, 2.0, 3.0], 1),
    "late jump": ([0.0, 0.0, 0.0, 10.0], 3),
    "masked first tile": ([float("-inf"), float("-inf"), 2.0, 2.0, 1.0, 0.0], 2),
}


def test_exercise_5_predicted_error_matches_brute_force(answers):
    predicted = answers.predict_rescale_error()
    assert set(predicted) == set(PREDICTION_ROWS), f"predict every row: {sorted(PREDICTION_ROWS)}"
    for name, (row, size) in PREDICTION_ROWS.items():
        scores = torch.tensor(row, dtype=torch.float64)
        ratio = broken_normalizer(scores, size) / torch.exp(scores - scores.max()).sum()
        assert float(predicted[name]) == pytest.approx(float(ratio), rel=1e-6), \
            f"{name!r}: l_broken / l_true is {float(ratio):.6f}, you predicted {float(predicted[name]):.6f}"


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
