"""Mechanism figures of lessons 00-05, 07, 09 and 10: the data each picture draws, checked independently.

The pictures themselves are cells tagged "mechanism" in the notebooks (listed with the others in
tests/test_figures.py). Each draws what the package's own objects compute: the merges BPE makes,
the tokens each forward is fed as the window slides, what each sampling filter keeps, the
penalties' bookkeeping, one number's bits in three formats, where each token lands in the KV
cache under left and right padding, what a stream shows and holds back, and beam search's
survivors step by step. Here each is replayed against its definition or a brute force, without
the real model.
"""

from __future__ import annotations

import itertools
import math
import random
import struct
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minillm import Transformer, generate
from minillm.cache.kv_cache import DynamicCache
from minillm.decoding.sampling import (
    TokenHistory,
    apply_min_p,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
)
from minillm.model.bpe import BytePairEncoding, bpe_merge
from minillm.model.config import ModelConfig
from minillm.model.tokenizer import gpt2_tokenizer
from minillm.runtime.batching import attention_mask, pad_left, pad_right
from minillm.runtime.session import DecodeSession
from minillm.strategies.beam import beam_search
from minillm.strategies.streaming import REPLACEMENT, IncrementalDecoder

# ------------------------------------------------------------------ 00: BPE, merge by merge


def test_bpe_merge_steps_take_the_lowest_rank():
    """Lesson 00's figure reads the parts bpe_merge holds before each merge from the pairs it asks rank_of about,
    one left-to-right scan of the current parts per merge. Replayed from the definition: each scan is exactly the
    adjacent pairs of the parts so far, each merge joins the pair of lowest rank (leftmost on a tie), it stops when
    no adjacent pair is a token, and the tokens are tiktoken's."""
    encoding = gpt2_tokenizer().encoding
    ranks = encoding._mergeable_ranks
    bpe = BytePairEncoding.from_tiktoken(encoding)
    texts = ["Tokenization isn't magic 😀", " lower tokenization", "Größenordnung: 3,5 µm", "for (i = 0; i < n; ++i)",
             "aaaaaaaa bbbbbbbbbbbb", "👩🏽‍💻 静かな湖"]
    for text in texts:
        ids = []
        for piece in bpe.pre_tokenize(text):
            asked = []  # every (left, right) bpe_merge asks rank_of about, in order
            final = bpe_merge(piece.encode(), lambda a, b: asked.append((a, b)) or bpe.rank_of(a, b))
            parts = [bytes([b]) for b in piece.encode()]
            while len(parts) > 1:
                pairs = list(zip(parts, parts[1:]))
                assert asked[:len(pairs)] == pairs, piece           # one scan of the current parts, left to right
                asked = asked[len(pairs):]
                ranked = [(ranks[a + b], i) for i, (a, b) in enumerate(pairs) if a + b in ranks]
                if not ranked:
                    break
                _, i = min(ranked)
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            assert asked == [] and final == parts, piece
            ids += [ranks[part] for part in parts]
        assert ids == encoding.encode(text), text


# ------------------------------------------------------------------ 02: the sliding window, forward by forward


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("slide", [1, 5, 12])
def test_each_forward_is_fed_the_window_or_the_newest_token(slide, cache):
    """Lesson 02's figure, from a hook on a tiny random model: the window starts at 0 while the row fits, then at the
    first multiple of window_slide that leaves at most context_length tokens; each forward is fed the whole window
    at positions 0, 1, ... when the window has just moved (and for the prompt), else the newest token alone at its
    place in the window."""
    torch.manual_seed(0)
    context, prompt_length, new = 12, 7, 30
    model = Transformer(ModelConfig(vocab_size=64, context_length=context, n_layer=1, n_head=2, d_model=16,
                                    tie_embeddings=False)).eval()
    prompt = [(5 * i) % 64 for i in range(prompt_length)]
    run = generate(model, [prompt], max_new_tokens=new, eos_token_id=(), window_slide=slide, cache=cache,
                   stream=True, compile=False)
    seq, fed = run.seqs[0], []
    hook = model.register_forward_pre_hook(
        lambda module, args: fed.append((seq.window_start, args[1][0].tolist(), args[0][0].tolist())))
    try:
        for _ in run:
            pass
    finally:
        hook.remove()
    sequence = prompt + run.output.rows[0].token_ids
    assert len(fed) == new
    for step, (start, positions, tokens) in enumerate(fed):
        length = prompt_length + step
        assert start == slide * math.ceil(max(0, length - context) / slide)
        moved = step == 0 or start != fed[step - 1][0]
        first = start if moved else length - 1
        assert tokens == sequence[first:length] and positions == list(range(first - start, length - start))


# ------------------------------------------------------------------ 03: what each filter keeps


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    return [e / sum(exps) for e in exps]


@pytest.mark.parametrize("seed", range(20))
def test_filters_keep_what_their_definitions_keep(seed):
    """Lesson 03's figure: each filter's kept set (not -inf) equals its definition on plain floats. Top-k: z_i >=
    the k-th largest logit, ties kept. Top-p: the shortest best-first prefix whose mass reaches p (p between two
    prefix masses, so rounding cannot decide). Min-p: p_i >= min_p · max p (the cut between two levels). And
    temperature: softmax(z / T), nothing removed."""
    rng = random.Random(seed)
    V = rng.randrange(2, 40)
    logits = [round(rng.gauss(0, 2), 1) for _ in range(V)]         # rounded: ties happen
    z = torch.tensor([logits])

    def kept(out):
        return (out[0] > -math.inf).tolist()

    probs = softmax(logits)

    T = rng.uniform(0.3, 3.0)
    torch.testing.assert_close(apply_temperature(z, T).softmax(-1)[0], torch.tensor(softmax([x / T for x in logits])))
    k = rng.randrange(1, V + 1)
    kth = sorted(logits, reverse=True)[k - 1]
    assert kept(apply_top_k(z, k)) == [x >= kth for x in logits]

    best_first = sorted(probs, reverse=True)
    prefix = [sum(best_first[:m]) for m in range(1, V + 1)]         # the mass of the best m tokens
    m = rng.randrange(0, V - 1)
    p = (prefix[m] + prefix[m + 1]) / 2                             # needs m + 2 tokens to reach it
    keep = kept(apply_top_p(z, p))
    assert sum(keep) == m + 2
    assert min(q for q, on in zip(probs, keep) if on) >= max([q for q, on in zip(probs, keep) if not on], default=0)

    levels = sorted(set(logits), reverse=True)
    if len(levels) > 1:
        cut = rng.randrange(1, len(levels))                          # keep the tokens of the best `cut` levels
        threshold = (math.exp(levels[cut - 1] - levels[0]) + math.exp(levels[cut] - levels[0])) / 2  # ÷ max p
        assert kept(apply_min_p(z, threshold)) == [x >= levels[cut - 1] for x in logits]


# ------------------------------------------------------------------ 04: the penalties


@pytest.mark.parametrize("seed", range(20))
def test_penalties_follow_their_formulas(seed):
    """Lesson 04's figure: a TokenHistory given a prompt and fed generated tokens one at a time holds seen = the
    tokens of both and generated_counts = how often each was generated; the repetition penalty divides a positive
    seen logit by r and multiplies a non-positive one; presence/frequency subtract presence·[c > 0] + frequency·c,
    c counting generated tokens only."""
    rng = random.Random(seed)
    V = rng.randrange(2, 30)
    prompt = [rng.randrange(V) for _ in range(rng.randrange(0, 10))]
    generated = [rng.randrange(V) for _ in range(rng.randrange(0, 12))]
    logits = [rng.choice([0.0, round(rng.gauss(0, 3), 2)]) for _ in range(V)]  # zeros, negatives, positives
    r, presence, frequency = rng.uniform(0.5, 2.0), rng.uniform(-2, 2), rng.uniform(-2, 2)
    history = TokenHistory.from_prompts([prompt], V)
    for token in generated:
        history.add(torch.tensor([token]))
    counts = Counter(generated)
    assert history.seen[0].tolist() == [i in prompt or i in generated for i in range(V)]
    assert history.generated_counts[0].tolist() == [counts[i] for i in range(V)]
    z = torch.tensor([logits])
    repetition = [(x / r if x > 0 else x * r) if i in prompt or i in generated else x for i, x in enumerate(logits)]
    torch.testing.assert_close(apply_repetition_penalty(z, history.seen, r)[0], torch.tensor(repetition))
    fees = [x - presence * (counts[i] > 0) - frequency * counts[i] for i, x in enumerate(logits)]
    torch.testing.assert_close(apply_presence_frequency_penalty(z, history.generated_counts, presence, frequency)[0],
                               torch.tensor(fees))


# ------------------------------------------------------------------ 05: one number's bits in three formats


FLOAT_FORMATS = {  # name: (dtype, the integer dtype of the same width, exponent bits, mantissa bits)
    "float32": (torch.float32, torch.int32, 8, 23),
    "bfloat16": (torch.bfloat16, torch.int16, 8, 7),
    "float16": (torch.float16, torch.int16, 5, 10),
}


@pytest.mark.parametrize("seed", range(4))
def test_float_bits_follow_their_formats(seed):
    """Lesson 05's figure: the patterns torch stores are struct's (float32) and numpy's (float16); bfloat16's is
    float32's plus 0x7FFF plus its lowest kept bit, top 16 bits; every pattern's fields decode by the definition
    (-1)^s · 2^(e - bias) · 1.m; and each 16-bit value is the nearest point of its grid, 2^(floor(log2|x|) - m)
    apart, ties to an even multiple. Normal numbers from 1e-3 to 1e4, both signs, and exact ties."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = 10 ** (torch.rand(300, generator=gen) * 7 - 3)                 # 1e-3 .. 1e4: normal in all three
    signs = torch.where(torch.rand(300, generator=gen) < 0.5, -1.0, 1.0)
    ties = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-11), 1 + 3 * 2**-11, 2 - 2**-9]  # halfway for bf16 or fp16
    for number in (magnitudes * signs).tolist() + ties + [-10.3]:
        exact = float(torch.tensor(number))                                     # the float32 value
        bits = {}
        for name, (dtype, same_width, e_bits, m_bits) in FLOAT_FORMATS.items():
            stored = torch.tensor(number).to(dtype)
            bits[name] = int(stored.view(same_width)) & (2 ** (1 + e_bits + m_bits) - 1)
            sign, exponent = bits[name] >> (e_bits + m_bits), (bits[name] >> m_bits) & (2**e_bits - 1)
            mantissa, bias = bits[name] & (2**m_bits - 1), 2 ** (e_bits - 1) - 1
            assert 0 < exponent < 2**e_bits - 1
            assert (-1) ** sign * 2.0 ** (exponent - bias) * (1 + mantissa / 2**m_bits) == float(stored)
            if name != "float32":
                step = 2.0 ** (math.floor(math.log2(abs(exact))) - m_bits)
                below = math.floor(exact / step) * step
                low_gap, high_gap = exact - below, below + step - exact
                even = below if round(below / step) % 2 == 0 else below + step
                nearest = below if low_gap < high_gap else below + step if high_gap < low_gap else even
                assert float(stored) == nearest, (number, name)
        assert bits["float32"] == struct.unpack(">I", struct.pack(">f", exact))[0]
        assert bits["float16"] == int(np.array(exact, dtype=np.float32).astype(np.float16).view(np.uint16))
        assert (bits["float32"] + 0x7FFF + ((bits["float32"] >> 16) & 1)) >> 16 == bits["bfloat16"]


# ------------------------------------------------------------------ 07: where each token lands in the cache


class CacheRecorder:
    """Stands in for a model: one layer, one KV head; writes [token id, forward number] as each token's key and
    [position, 0] as its value, so a cache can be read back, and keeps every forward's mask."""

    config = SimpleNamespace(n_layer=1, kv_heads=1, head_size=2, context_length=64, cache_widths=(1, 2, 2))
    dtype, device = torch.float32, torch.device("cpu")

    def __init__(self):
        self.masks = []

    def __call__(self, tokens, positions, cache=None, mask=None, **unused):
        self.masks.append(mask)
        forward = torch.full_like(tokens, len(self.masks))
        cache.update(0, torch.stack([tokens, forward], -1)[:, None].float(),
                     torch.stack([positions, torch.zeros_like(positions)], -1)[:, None].float())
        return torch.zeros(*tokens.shape, 1)


@pytest.mark.parametrize("seed", range(10))
def test_cache_layouts_hold_what_the_rules_say(seed):
    """Lesson 07's figure, for random prompt lengths: left padding with one length holds each row's tokens after its
    padding, positions restarting at 0, and masks exactly the padding; right padding with one length puts every new
    token at the shared column L + s, after the padding; the session holds row b's token at position p in column p,
    each decode step sees the row's stored columns and itself (no mask when the rows are equally long)."""
    rng = random.Random(seed)
    lengths, steps = [rng.randrange(1, 8) for _ in range(rng.randrange(1, 5))], rng.randrange(1, 4)
    prompts = [[100 * (b + 1) + p for p in range(n)] for b, n in enumerate(lengths)]  # ids never 0 (padding)
    new = torch.tensor([[100 * (b + 1) + n + s for s in range(steps)] for b, n in enumerate(lengths)])  # [B, steps]
    whole = [p + n for p, n in zip(prompts, new.tolist())]
    rows, width = len(prompts), max(lengths)

    left, left_cache = CacheRecorder(), DynamicCache(1)
    tokens, valid, positions = pad_left(prompts)
    left(tokens, positions, cache=left_cache, mask=attention_mask(valid, width))
    naive, naive_cache = CacheRecorder(), DynamicCache(1)
    right_tokens, _, right_positions = pad_right(prompts)
    naive(right_tokens, right_positions, cache=naive_cache)
    model = CacheRecorder()
    session = DecodeSession(model, "static", max_len=width + steps, max_batch=rows)
    session.prefill(prompts)
    for s in range(steps):
        valid = torch.cat([valid, torch.ones(rows, 1, dtype=torch.bool)], 1)
        positions = positions[:, -1:] + 1
        left(new[:, s:s + 1], positions, cache=left_cache, mask=attention_mask(valid, 1))
        naive(new[:, s:s + 1], torch.full((rows, 1), width + s), cache=naive_cache)
        session.extend(new[:, s:s + 1])

    columns = width + steps
    for b, (prompt, row) in enumerate(zip(prompts, whole)):
        pad = width - len(prompt)
        keys, values = left_cache.keys[0][b, 0], left_cache.values[0][b, 0]       # [S, 2]
        assert keys[:, 0].tolist() == [0] * pad + row and values[:, 0].tolist() == [0] * pad + list(range(len(row)))
        assert left.masks[-1][b, 0].tolist() == [c >= pad for c in range(columns)]
        keys, values = naive_cache.keys[0][b, 0], naive_cache.values[0][b, 0]
        assert keys[:, 0].tolist() == prompt + [0] * pad + row[len(prompt):]
        assert values[:, 0].tolist() == list(range(columns))
        n = len(row)
        keys, values = session.cache.k[0, b, 0], session.cache.v[0, b, 0]         # [max_len, 2]
        assert session.cache.lengths[b] == n and keys[:n, 0].tolist() == row
        assert values[:n, 0].tolist() == list(range(n))                          # position p in column p
        assert (keys[n:width, 0] == 0).all() and (keys[n:width, 1] == 1).all()  # the prefill's padding, stale
        assert (keys[max(n, width):, 1] == 0).all()                              # never written
    for s, mask in enumerate(model.masks[1:]):
        if len(set(lengths)) == 1:
            assert mask is None
        else:
            starts = [n + s for n in lengths]
            assert mask[:, 0].tolist() == [[c <= start for c in range(max(starts) + 1)] for start in starts]
    assert model.masks[0] is None


# ------------------------------------------------------------------ 09: what each push shows


@pytest.mark.parametrize("text", ["Café 😀 世界!", "naïve 🇫🇷 नमस्ते 👩‍👩‍👧 ok.", "日本語 ∑ x² ≤ 10⁻³, e\u0301 👍🏽"])
def test_stream_shows_each_prefix_decoded(text):
    """Lesson 09's figure: after every GPT-2 token, the text IncrementalDecoder has shown is the whole prefix decoded
    less its trailing U+FFFD, and the bytes it holds back (fewer than 4) are the start of a UTF-8 character that is
    still arriving: the bytes so far end in the middle of one, not in an invalid byte."""
    gpt2 = gpt2_tokenizer()
    ids = gpt2.encode(text)
    decoder, shown = IncrementalDecoder(gpt2), ""
    held_somewhere = False
    for t, token in enumerate(ids):
        shown += decoder.push([token])
        assert shown == gpt2.decode(ids[:t + 1]).rstrip(REPLACEMENT)
        arrived = b"".join(gpt2.token_bytes(i) for i in ids[:t + 1])
        held = arrived[len(shown.encode()):]
        assert arrived.startswith(shown.encode()) and len(held) < 4
        if held:
            held_somewhere = True
            with pytest.raises(UnicodeDecodeError, match="unexpected end of data"):
                arrived.decode("utf-8")
    assert held_somewhere and decoder.flush() == "" and shown == text


# ------------------------------------------------------------------ 10: beam search, step by step


class CachedTree(torch.nn.Module):
    """A random tree over the tokens a, b, c and the end token "." as a model that keeps nothing itself: it writes
    the token ids into the KV cache and reads each row's tokens back from it, so its logits are right only if the
    cache rows follow their beams."""

    TOKENS = "abc."

    def __init__(self, seed):
        super().__init__()
        self.seed, self.rows_seen = seed, []
        self.config = SimpleNamespace(vocab_size=5, context_length=16, n_layer=1, kv_heads=1, head_size=1,
                                      cache_widths=(1, 1, 1))
        self.dtype, self.device = torch.float32, torch.device("cpu")

    def probabilities(self, prefix):
        rng = random.Random(f"{self.seed}/{prefix}")
        weights = [rng.random() + 0.05 for _ in self.TOKENS]
        return {token: w / sum(weights) for token, w in zip(self.TOKENS, weights)}

    def forward(self, tokens, positions, cache=None, mask=None, **unused):
        keys, _ = cache.update(0, tokens[:, None, :, None].float(), tokens[:, None, :, None].float())
        rows = keys[:, 0, :, 0].long().tolist()
        self.rows_seen.append(sorted("".join(self.TOKENS[i] for i in row[1:positions[b, -1] + 1])
                                     for b, row in enumerate(rows)))
        logits = torch.full((*tokens.shape, 5), -math.inf)
        for b, t in itertools.product(range(tokens.shape[0]), range(tokens.shape[1])):
            prefix = "".join(self.TOKENS[i] for i in rows[b][1:positions[b, t] + 1])
            for index, p in enumerate(self.probabilities(prefix).values()):
                logits[b, t, index] = math.log(p)
        return logits


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_beam_steps_follow_the_rules(seed, cache):
    """Lesson 10's figure, on random trees: at every step the beams the cache holds are the best num_beams
    extensions that do not end among the best 2 · num_beams of all extensions of the running beams (brute force);
    those among the best num_beams that end (".", or the last step) finish with log-prob / n^length_penalty; the
    search returns the best num_beams finished, with those scores. early_stopping="never" stops only when no later
    hypothesis can enter, so the brute force may run every step."""
    rng = random.Random(seed)
    beams, max_new, penalty = rng.choice([2, 3]), rng.randrange(2, 6), rng.choice([-1.0, 0.0, 1.0, 2.0])
    model = CachedTree(seed)
    out = beam_search(model, [4], num_beams=beams, num_return_sequences=beams, max_new_tokens=max_new,
                      eos_token_id=3, length_penalty=penalty, early_stopping="never", cache=cache)
    score = lambda path: sum(math.log(model.probabilities(path[:i])[path[i]]) for i in range(len(path)))

    running, finished = [""], []
    for n in range(1, max_new + 1):
        candidates = sorted((path + token for path in running for token in CachedTree.TOKENS), key=lambda c: -score(c))
        ends = [c.endswith(".") or n == max_new for c in candidates]
        finished += [(c, score(c) / n**penalty) for c, end in zip(candidates[:beams], ends) if end]
        running = [c for c, end in zip(candidates[:2 * beams], ends) if not end][:beams]
        if n < len(model.rows_seen):                                             # the package fed these beams
            assert model.rows_seen[n] == sorted(running)
    best = sorted(finished, key=lambda f: -f[1])[:beams]
    found = [("".join(CachedTree.TOKENS[i] for i in row), s) for row, s in zip(out.token_ids, out.sequences_scores)]
    assert [path for path, _ in found] == [path for path, _ in best]
    assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(found, best))
