"""The engine under every lesson: one-way layers, the decode session, per-row settings, module swaps.

References: a plain forward over the whole sequence with no cache (the session's verbs
must match it), each row run alone (batched rows must match it), exact string search
(stop strings), and the plain nn.Linear model (the oneDNN swap must match it).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minillm.decoding.sampling import SamplingConfig
from minillm.decoding.stopping import RowState
from minillm.model.tiny import tiny_pair
from minillm.model.transformer import causal_positions
from minillm.runtime.session import DecodeSession, Tree
from minillm.speed.onednn import OneDNNLinear, use_onednn, use_plain_linear, uses_onednn
from minillm.strategies.generate import generate

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"

# ------------------------------------------------------------------ layers

# Lowest first; a module may import from its own layer or any layer below it. A subpackage is one
# layer (the course's part it holds); the entry points (`python -m minillm.infer|serve|export|bench`)
# are front ends above everything.
LAYERS = {
    "base": {"base"},
    "model": {"model"},
    "cache": {"cache"},
    "speed": {"speed"},
    "parallel": {"parallel"},
    "decoding": {"decoding"},
    "runtime": {"runtime"},
    "strategies": {"strategies"},
    "serving": {"serving"},
    "cost model": {"costmodel"},
    "front ends": {"infer", "infer_flags", "serve", "export", "compile", "bench", "__main__", "__init__"},
}
RANK = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}


def package_imports() -> dict[str, list[tuple[str, list[str]]]]:
    """module (first dotted part inside minillm) -> [(imported module, imported names)], every import
    statement in the file, deferred ones inside functions included."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).with_suffix("")
        module = relative.parts[0]
        package_parts = relative.parts[:-1]
        edges = found.setdefault(module, [])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = list(package_parts[: len(package_parts) - node.level + 1])
                target = base + (node.module.split(".") if node.module else [])
                names = [a.name for a in node.names]
                if target:
                    edges.append((target[0], names))
                else:  # `from . import x` names modules
                    edges.extend((name, []) for name in names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minillm."):
                edges.append((node.module.split(".")[1], [a.name for a in node.names]))
    return found


def test_every_module_has_a_layer():
    modules = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.glob("*") if
               p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert modules - set(RANK) == set(), "place new modules in LAYERS (and DESIGN's layer list)"


def test_imports_point_down_the_layers():
    upward = [f"{module} ({_layer(module)}) imports {target} ({_layer(target)})"
              for module, edges in package_imports().items() for target, _ in edges
              if target != module and RANK[target] > RANK[module]]
    assert upward == []


def test_no_import_cycles():
    graph = {module: {t for t, _ in edges if t != module} for module, edges in package_imports().items()}
    state = {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        assert state.get(node) != "active", f"import cycle: {' -> '.join(path + [node])}"
        state[node] = "active"
        for nxt in graph.get(node, ()):
            visit(nxt, path + [node])
        state[node] = "done"

    for module in graph:
        visit(module, [])


def module_imports() -> dict[str, set[str]]:
    """Every module of the package (dotted, 'bench.report') -> the package's modules it imports, deferred
    imports inside functions included ('from . import x' names module x where x is one)."""
    modules = {".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")[:-1]
        targets = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - node.level + 1]
            elif (node.module or "").startswith("minillm."):
                base = []
            else:
                continue
            stem = ".".join(base + (node.module.split(".") if node.module else [])).removeprefix("minillm.")
            for alias in node.names:
                for target in (f"{stem}.{alias.name}".strip("."), stem, f"{stem}.__init__".strip(".")):
                    if target in modules and target != name:
                        targets.add(target)
                        break
    return graph


def test_no_import_cycles_between_modules():
    """Within a subpackage too: a cycle of modules (bench's cli -> report -> sections -> cost -> cli was one)
    means no file of it can be read, or imported, on its own."""
    graph, state = module_imports(), {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        assert state.get(node) != "active", f"import cycle: {' -> '.join(path + [node])}"
        state[node] = "active"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_no_private_names_cross_modules():
    private = [f"{module} imports {name} from {target}" for module, edges in package_imports().items()
               for target, names in edges for name in names if target != module and name.startswith("_")]
    assert private == []


def _layer(module: str) -> str:
    return next(name for name, modules in LAYERS.items() if module in modules)


def test_python_dash_m_minillm_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "minillm", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--prompt" in result.stdout and "python -m minillm" in result.stdout


# ------------------------------------------------------------------ the session against recomputation


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, no cache: the reference for every verb. [T, V]"""
    with torch.inference_mode():
        return model(torch.tensor([ids]), causal_positions(1, len(ids)))[0]


CACHES = ["static", "dynamic", "none"]


@pytest.fixture(params=["gpt2", "llama"])
def tiny_model(request):
    return tiny_pair(request.param, seed=2)[1]


@pytest.mark.parametrize("cache", CACHES)
def test_rows_of_different_lengths_equal_each_row_alone(tiny_model, cache):
    rows = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    session = DecodeSession(tiny_model, cache, max_len=20)
    with torch.inference_mode():
        first = session.prefill(rows)  # [3, V]
        steps = session.extend([[1, 2], [3, 4], [5, 6]])  # [3, 2, V]
    for b, (row, new) in enumerate(zip(rows, [[1, 2], [3, 4], [5, 6]])):
        torch.testing.assert_close(first[b], full_logits(tiny_model, row)[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(steps[b], full_logits(tiny_model, row + new)[-2:], atol=1e-5, rtol=1e-5)
    assert session.lengths == [9, 4, 6]


@pytest.mark.parametrize("cache", CACHES)
def test_rollback_then_extend_equals_never_extended(tiny_model, cache):
    rows = [[3, 4, 5, 6], [7, 8, 9]]
    session = DecodeSession(tiny_model, cache, max_len=20)
    with torch.inference_mode():
        session.prefill(rows)
        session.extend([[10, 11, 12], [13, 14, 15]])  # three drafted tokens per row
        session.rollback([5, 4])  # row 0 keeps one of them, row 1 keeps one too
        after = session.extend([[20], [21]])[:, -1]
    kept = [[3, 4, 5, 6, 10, 20], [7, 8, 9, 13, 21]]
    assert session.rows == kept
    for b, ids in enumerate(kept):
        torch.testing.assert_close(after[b], full_logits(tiny_model, ids)[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", CACHES)
def test_tree_extend_equals_each_path_forwarded_alone(tiny_model, cache):
    prefix = [3, 4, 5, 6, 7]
    # node: 0 root, 1 and 2 children of 0, 3 child of 1, 4 child of 3: paths of depth up to 3
    parents, tokens = [-1, 0, 0, 1, 3], [8, 9, 10, 11, 12]
    session = DecodeSession(tiny_model, cache, max_len=20)
    with torch.inference_mode():
        session.prefill([prefix])
        logits = session.extend([tokens], tree=Tree.from_parents(parents))[0]  # [5, V]
    for node in range(len(tokens)):
        path, i = [], node
        while i >= 0:
            path.insert(0, tokens[i])
            i = parents[i]
        torch.testing.assert_close(logits[node], full_logits(tiny_model, prefix + path)[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", CACHES)
def test_keep_positions_equals_a_fresh_prefill_of_the_kept_sequence(tiny_model, cache):
    prefix = [3, 4, 5, 6]
    parents, tokens = [-1, 0, 0, 2], [8, 9, 10, 11]  # accepted path: nodes 0, 2, 3
    session = DecodeSession(tiny_model, cache, max_len=20)
    with torch.inference_mode():
        session.prefill([prefix])
        session.extend([tokens], tree=Tree.from_parents(parents))
        session.keep_positions(0, [0, 1, 2, 3, 4, 6, 7])
        after = session.extend([[13]])[0, -1]
    kept = prefix + [8, 10, 11, 13]
    assert session.rows == [kept]
    torch.testing.assert_close(after, full_logits(tiny_model, kept)[-1], atol=1e-5, rtol=1e-5)
    if cache != "none":
        fresh = DecodeSession(tiny_model, cache, max_len=20)
        with torch.inference_mode():
            fresh.prefill([kept])
        k_kept, k_fresh = stored_keys(session.cache, len(kept)), stored_keys(fresh.cache, len(kept))
        torch.testing.assert_close(k_kept, k_fresh, atol=1e-5, rtol=1e-5)


def stored_keys(cache, n: int) -> torch.Tensor:
    """Layer 0's stored keys of row 0, first n columns: [KV, n, hd]."""
    keys = cache.k[0] if hasattr(cache, "k") else cache.keys[0]
    return keys[0, :, :n]


def test_a_fixed_shape_cache_gives_the_same_logits(tiny_model):
    """What compiled graphs need: every forward sees all max_len columns, the mask hides the unwritten ones."""
    sessions = [DecodeSession(tiny_model, "static", max_len=16, fixed_shape=fixed) for fixed in (False, True)]
    with torch.inference_mode():
        outs = [[s.prefill([[3, 4, 5, 6], [7, 8]]), s.extend([[9], [10]]), s.extend([[11, 12], [13, 14]])]
                for s in sessions]
        k_all, _ = sessions[1].cache.update(0, *([sessions[1].cache.k[0, :2, :, :0]] * 2))
    assert k_all.shape[2] == 16
    for plain, fixed in zip(*outs):
        torch.testing.assert_close(fixed, plain, atol=1e-5, rtol=1e-5)


def test_select_duplicates_and_drops_rows(tiny_model):
    session = DecodeSession(tiny_model, "static", max_len=20, max_batch=3)
    with torch.inference_mode():
        session.prefill([[3, 4, 5], [6, 7]])
        session.select([1, 1, 0])
        after = session.extend([[8], [9], [10]])[:, -1]
    for b, ids in enumerate([[6, 7, 8], [6, 7, 9], [3, 4, 5, 10]]):
        torch.testing.assert_close(after[b], full_logits(tiny_model, ids)[-1], atol=1e-5, rtol=1e-5)


def test_tree_from_parents_builds_the_ancestor_mask():
    tree = Tree.from_parents([-1, 0, 1, 1])  # 1 -> 2 -> {3, 4}: the lookahead issue's example
    assert tree.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    assert tree.depth.tolist() == [0, 1, 2, 2]
    with pytest.raises(ValueError, match="parents must come before"):
        Tree.from_parents([-1, 2, 0])


def test_session_refuses_bad_verbs(tiny_model):
    session = DecodeSession(tiny_model, "static", max_len=8)
    with pytest.raises(ValueError, match="unknown cache kind"):
        DecodeSession(tiny_model, "paged")
    with torch.inference_mode():
        session.prefill([[1, 2, 3]])
        with pytest.raises(ValueError, match=r"rollback\(\[5\]\)"):
            session.rollback([5])
        with pytest.raises(ValueError, match=r"tokens must be \[batch=1, T\]"):
            session.extend([[1], [2]])


# ------------------------------------------------------------------ generation: events, inputs, per-row settings


def test_events_carry_the_same_tokens_and_text_as_the_output(tiny_with_tokenizer):
    model, tok = tiny_with_tokenizer
    run = generate(model, ["Hello there", "Hi"], tokenizer=tok, max_new_tokens=12, stream=True)
    tokens, texts, reasons = [[], []], ["", ""], [None, None]
    for event in run:
        tokens[event.row] += event.token_ids
        texts[event.row] += event.text
        assert reasons[event.row] is None  # nothing follows a row's finishing event
        reasons[event.row] = event.finish_reason
    out = generate(model, ["Hello there", "Hi"], tokenizer=tok, max_new_tokens=12)
    assert tokens == out.token_ids == run.output.token_ids
    assert texts == out.texts and reasons == [r.finish_reason for r in out.rows]


@pytest.fixture
def tiny_with_tokenizer():
    from minillm.model.tiny import from_hf_model, tiny_hf_model
    from minillm.model.tokenizer import gpt2_tokenizer

    return from_hf_model(tiny_hf_model("gpt2", vocab_size=50257, context_length=64)), gpt2_tokenizer()


def test_token_ids_as_1d_tensor_or_array_are_one_prompt(tiny_model):
    ids = [5, 6, 7, 8]
    expected = generate(tiny_model, [ids], max_new_tokens=5).token_ids
    assert generate(tiny_model, torch.tensor(ids), max_new_tokens=5).token_ids == expected
    assert generate(tiny_model, np.array(ids), max_new_tokens=5).token_ids == expected
    assert generate(tiny_model, torch.tensor([ids, ids]), max_new_tokens=5).token_ids == expected * 2
    with pytest.raises(ValueError, match="must be integers"):
        generate(tiny_model, torch.tensor([5.0, 6.0]), max_new_tokens=5)
    with pytest.raises(ValueError, match="prompts must be"):
        generate(tiny_model, {"a": 1}, max_new_tokens=5)


ROW_SETTINGS = [
    SamplingConfig(max_new_tokens=10, do_sample=True, temperature=0.7, top_k=5, seed=1, eos_token_id=()),
    SamplingConfig(max_new_tokens=6, eos_token_id=()),  # greedy, shorter
    SamplingConfig(max_new_tokens=12, do_sample=True, top_p=0.8, repetition_penalty=1.3, seed=2, eos_token_id=()),
    SamplingConfig(max_new_tokens=9, do_sample=True, temperature=1.3, min_p=0.1, frequency_penalty=0.5, seed=3,
                   eos_token_id=()),
]


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_rows_with_their_own_settings_equal_each_row_alone(tiny_model, cache):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
    batched = generate(tiny_model, prompts, ROW_SETTINGS, cache=cache)
    for prompt, config, row in zip(prompts, ROW_SETTINGS, batched.rows):
        alone = generate(tiny_model, [prompt], config, cache=cache).rows[0]
        assert row.token_ids == alone.token_ids and len(row.token_ids) == config.max_new_tokens
    assert len({tuple(r.token_ids) for r in batched.rows}) == len(prompts)


def test_a_list_of_configs_must_match_the_prompts(tiny_model):
    with pytest.raises(ValueError, match="2 configs for 3 prompts"):
        generate(tiny_model, [[1], [2], [3]], ROW_SETTINGS[:2])


# ------------------------------------------------------------------ stop strings with long tokens


class LongTokens:
    """A stub tokenizer whose tokens are whole strings, however long."""

    def __init__(self, vocabulary: list[str]):
        self.vocabulary, self.eos_token_id = vocabulary, None

    def decode(self, ids):
        return "".join(self.vocabulary[i] for i in ids)


@pytest.mark.parametrize("pieces, stop, text", [
    (["Say ", "END and more words than eight characters"], "END", "Say "),
    (["def f():", "\n                    return 1"], "\n", "def f():"),
    (["abc", "x" * 40 + "STOPxyz"], "STOP", "abc" + "x" * 40),
    (["ST", "O", "P" + "y" * 30], "STOP", ""),  # the stop string spans three tokens
])
def test_stop_strings_are_found_however_long_the_token(pieces, stop, text):
    tok = LongTokens(pieces)
    state = RowState([0], 10, stop=(stop,), tokenizer=tok)
    for i in range(len(pieces)):
        state.push(i)
        if state.finished:
            break
    assert state.finish_reason == "stop" and state.text == text and len(state.token_ids) == len(pieces)


# ------------------------------------------------------------------ the oneDNN module swap


def test_onednn_swap_keeps_parameters_and_ties(tiny_model):
    qwen = tiny_pair("qwen2")[1]  # tied embeddings
    params = {name: p for name, p in qwen.named_parameters()}
    use_onednn(qwen)
    assert uses_onednn(qwen) and type(qwen.lm_head) is OneDNNLinear
    assert qwen.lm_head.weight is qwen.tok_emb.weight
    assert all(p is params[name] for name, p in qwen.named_parameters())
    use_plain_linear(qwen)
    assert not uses_onednn(qwen) and type(qwen.lm_head) is torch.nn.Linear


def test_onednn_swap_gives_the_same_greedy_tokens_on_the_default_model(default_model):
    model, tok = default_model
    assert uses_onednn(model)  # load_model applies it on CPU float32
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt)
    with torch.inference_mode():
        fast_logits = model(torch.tensor([ids]), causal_positions(1, len(ids)))
        fast = generate(model, ids, max_new_tokens=24, eos_token_id=()).token_ids
        use_plain_linear(model)
        try:
            plain_logits = model(torch.tensor([ids]), causal_positions(1, len(ids)))
            plain = generate(model, ids, max_new_tokens=24, eos_token_id=()).token_ids
        finally:
            use_onednn(model)
    assert fast == plain
    torch.testing.assert_close(fast_logits, plain_logits, atol=2e-4, rtol=1e-4)
