"""Lesson 01: the model and its weights.

References: transformers' GPT2LMHeadModel / LlamaForCausalLM / Qwen2ForCausalLM with the
same weights, transformers' own GGUF reader for the real default model, and transformers'
tokenizer built from the same GGUF file.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from minillm import ModelLoadError, load_model
from minillm.base.files import minillm_home
from minillm.infer import main as cli_main
from minillm.model.loading import DEFAULT_GGUF, resolve_checkpoint_folder
from minillm.model.tiny import tiny_hf_model
from minillm.model.transformer import causal_positions


def _logits(model, tokens):
    return model(tokens, causal_positions(*tokens.shape))


def test_logits_match_transformers_weights_copied(tiny):
    hf_model, model = tiny
    tokens = torch.randint(0, model.config.vocab_size, (3, 40))
    with torch.no_grad():
        ours, theirs = _logits(model, tokens), hf_model(tokens).logits
    assert ours.shape == theirs.shape == (3, 40, model.config.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "bin"])
def test_logits_match_transformers_through_load_model(tiny_kind, tmp_path, safetensors):
    hf_model = tiny_hf_model(tiny_kind, seed=3)
    if safetensors:
        hf_model.save_pretrained(tmp_path)
    else:  # an old-style checkpoint: config.json + pytorch_model.bin (read with weights_only=True)
        hf_model.config.save_pretrained(tmp_path)
        torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    model, tokenizer = load_model(str(tmp_path))
    tokens = torch.randint(0, model.config.vocab_size, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, tokens), hf_model(tokens).logits, atol=2e-5, rtol=1e-5)
    # GPT-2 checkpoints use GPT-2's tokenizer (tiktoken); the tiny Llama folders ship none.
    assert (tokenizer is not None) == (tiny_kind == "gpt2")


def test_tied_embeddings_stay_tied_after_loading(tmp_path):
    hf_model = tiny_hf_model("qwen2")
    hf_model.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert model.lm_head.weight is model.tok_emb.weight


# ------------------------------------------------------------------ the real default model


def test_default_model_shape(default_model):
    model, tokenizer = default_model
    c = model.config
    assert (c.n_layer, c.d_model, c.n_head, c.kv_heads, c.vocab_size, c.rope_theta) == (30, 576, 9, 3, 49152, 100000.0)
    assert c.norm == "rmsnorm" and c.positions == "rope" and c.mlp == "swiglu" and c.tie_embeddings
    assert tokenizer.eos_token_id == 2 and tokenizer.decode([2]) == "<|im_end|>"


@pytest.fixture(scope="module")
def transformers_gguf_model():
    """transformers' own GGUF loader: dequantization and Q/K un-permutation done independently of ours."""
    from transformers import AutoModelForCausalLM

    resolve_checkpoint_folder("default")
    gguf = minillm_home() / "gguf" / DEFAULT_GGUF.member.split("/")[-1]
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
]


def test_default_logits_match_transformers_gguf_loader(default_model, transformers_gguf_model):
    model, tokenizer = default_model
    tokens = torch.tensor([tokenizer.encode(PROMPTS[0] + " Paris, and the capital of Italy is Rome.")])
    with torch.no_grad():
        ours, theirs = _logits(model, tokens), transformers_gguf_model(tokens).logits
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_default_greedy_continuations_match_transformers(default_model, reference_default_model):
    from minillm.strategies.generate import generate

    model, tokenizer = default_model
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = generate(model, [ids], max_new_tokens=32, tokenizer=tokenizer).token_ids[0]
        theirs = reference_default_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32,
            do_sample=False, eos_token_id=2, pad_token_id=2,
        )[0, len(ids):].tolist()
        assert ours == theirs, prompt


# ------------------------------------------------------------------ tokenizers


def _varied_strings(n: int = 300) -> list[str]:
    rng = random.Random(0)
    pieces = ["hello", " world", "Hello", "  ", "\n", "\t", "\n\n", "   indented", "1234567", "3.14159", "2024-11-22",
              "é", "ñ", "ü", "日本語", "中文字符", "한국어", "😀", "👍🏽", "🇫🇷", "e\u0301", "Ω≈ç√", "def f(x):", "    return x",
              "{'a': [1, 2]}", "<|im_start|>", "<|im_end|>", "http://example.com/a?b=c", "#include <stdio.h>",
              "   ", "don't", "I'm", "CamelCase", "snake_case", "ALLCAPS", "!!!", "...", "—", "«»", "\u200b", "\r\n"]
    out = ["", " ", "a", "The quick brown fox jumps over the lazy dog.", "x" * 100, "9" * 30]
    while len(out) < n:
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
    return out


@pytest.fixture(scope="module")
def transformers_gguf_tokenizer():
    from transformers import AutoTokenizer

    resolve_checkpoint_folder("default")
    gguf = minillm_home() / "gguf" / DEFAULT_GGUF.member.split("/")[-1]
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_default_tokenizer_matches_transformers(default_model, transformers_gguf_tokenizer):
    """Same ids as transformers' tokenizer built from the GGUF, and decode(encode(s)) == s.

    transformers 5.x does not know GGUF's `smollm` pre-tokenizer and falls back to GPT-2's
    split, so it differs from the model's real tokenizer where whitespace touches a digit
    ("  2024": the model was trained on "  " + "2" ..., GPT-2's rule gives " " + " 2" ...).
    We therefore compare (a) on digit-free strings with transformers as it is, and (b) on
    all strings with transformers' tokenizer given llama.cpp's `smollm` rule: isolate every
    digit, then split with GPT-2's regex (written as plain regex splits, independent of
    the Digits + ByteLevel pre-tokenizers minillm uses).
    """
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from minillm.model.tokenizer import GPT2_PATTERN

    _, tokenizer = default_model
    strings = _varied_strings()
    for s in strings:
        assert tokenizer.decode(tokenizer.encode(s)) == s
    digit_free = [s for s in strings if not any(c.isdigit() for c in s)]
    assert len(digit_free) > 50
    as_is = [(s, tokenizer.encode(s)) for s in digit_free
             if tokenizer.encode(s) != transformers_gguf_tokenizer.encode(s, add_special_tokens=False)]
    assert not as_is, as_is[:3]

    reference = Tokenizer.from_str(transformers_gguf_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    fixed = [(s, tokenizer.encode(s)) for s in strings
             if tokenizer.encode(s) != reference.encode(s, add_special_tokens=False).ids]
    assert not fixed, fixed[:3]
    assert tokenizer.encode("  2024") == reference.encode("  2024", add_special_tokens=False).ids


def test_default_chat_template_matches_transformers(default_model, transformers_gguf_tokenizer):
    _, tokenizer = default_model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    for msgs in (messages, messages[1:]):
        ours = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        theirs = transformers_gguf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours == theirs


def test_gpt2_tokenizer_known_ids():
    from minillm.model.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eos_token_id == 50256
    for s in _varied_strings(100):
        assert tok.decode(tok.encode(s)) == s


# ------------------------------------------------------------------ bad input: one clear line


def _cli_error(capsys, *argv) -> str:
    capsys.readouterr()  # drop what setting the test up printed (e.g. transformers' save progress bar)
    code = cli_main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minillm: error:"), err
    assert "Traceback" not in err
    return lines[0]


def test_cli_unknown_model_name(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = _cli_error(capsys, "--prompt", "hi", "--model", "no-such-org/no-such-model")
    assert "no-such-org/no-such-model" in line and "default" in line
    assert "unknown model" in _cli_error(capsys, "--prompt", "hi", "--model", "bad name with spaces")


def test_cli_folder_without_weights(capsys, tmp_path):
    tiny_hf_model("llama").config.save_pretrained(tmp_path)
    assert "has no weights" in _cli_error(capsys, "--prompt", "hi", "--model", str(tmp_path))
    assert "no config.json" in _cli_error(capsys, "--prompt", "hi", "--model", str(tmp_path.parent))


def test_cli_truncated_safetensors(capsys, tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "corrupt" in _cli_error(capsys, "--prompt", "hi", "--model", str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_cli_corrupt_gguf(capsys, tmp_path, monkeypatch, damage):
    resolve_checkpoint_folder("default")  # the real GGUF is on disk: damage a copy of it
    source = minillm_home() / "gguf" / DEFAULT_GGUF.member.split("/")[-1]
    monkeypatch.setenv("MINILLM_HOME", str(tmp_path / "home"))  # any conversion of the bad file lands here
    bad = tmp_path / "bad.gguf"
    with open(source, "rb") as f:
        head = f.read(2_000_000)
    bad.write_bytes(head if damage == "truncated" else b"GGUF" + bytes(range(256)) * 10)
    assert "bad.gguf" in _cli_error(capsys, "--prompt", "hi", "--model", str(bad))


def test_cli_unsupported_architecture(capsys, tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "bert"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "unsupported architecture 'bert'" in _cli_error(capsys, "--prompt", "hi", "--model", str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    monkeypatch.setenv("MINILLM_HOME", str(tmp_path / "home"))
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'phi2'"):
        load_model(str(path))


def test_cli_bad_arguments(capsys):
    assert "empty" in _cli_error(capsys, "--prompt", "   ")
    assert "--max-new-tokens -1" in _cli_error(capsys, "--prompt", "hi", "--max-new-tokens", "-1")
    assert "dtype 'float8'" in _cli_error(capsys, "--prompt", "hi", "--dtype", "float8")
    assert "device" in _cli_error(capsys, "--prompt", "hi", "--device", "tpu")
    assert "no prompt" in _cli_error(capsys)
    assert "--max-new-tokens" in _cli_error(capsys, "--prompt", "hi", "--max-new-tokens", "many")


def test_hub_names_go_through_huggingface_hub(tmp_path, monkeypatch):
    """Online, a hub name is fetched by snapshot_download; here a local folder stands in for the hub."""
    import huggingface_hub

    hf_model = tiny_hf_model("gpt2")
    hf_model.save_pretrained(tmp_path)
    asked = []

    def fake_snapshot_download(repo_id, **kwargs):
        asked.append(repo_id)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, tokenizer = load_model("gpt2")
    assert asked == ["gpt2"] and tokenizer.encode("Hello world") == [15496, 995]
    tokens = torch.randint(0, model.config.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, tokens), hf_model(tokens).logits, atol=2e-5, rtol=1e-5)


def test_notebook_runs(run_notebook):
    run_notebook("01_model_and_weights.ipynb")
