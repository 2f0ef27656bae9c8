"""Manifests: what a cache entry should hold (each file's size and sha256), checked before the entry is used.

Like git's index, a record also keeps each file's stat, so the quick check (size, mtime,
ctime unchanged) costs microseconds and only a file whose stat changed is hashed again.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import sha256_of
from .jsonio import write_json

MANIFEST = "manifest.json"


def file_record(path: Path) -> dict:
    """What a file should be (size, sha256), plus the stat fields that let a later check skip the hash.

    Like git's index: a file whose size, mtime and ctime are unchanged since we hashed
    it has not been written to since (ctime cannot be set back, even by `touch`).
    """
    st = path.stat()
    return {"size": st.st_size, "sha256": sha256_of(path), "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def file_problem(path: Path, record: dict, thorough: bool) -> str | None:
    """Why `path` is not the file `record` describes, or None.

    Quick (thorough=False): size and stat must be unchanged; a changed stat counts as a
    problem, for the caller to settle thoroughly. Thorough: size and sha256 must match.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path.name} is missing"
    if st.st_size != record["size"]:
        return f"{path.name} has {st.st_size} bytes, not {record['size']}"
    if thorough:
        return None if sha256_of(path) == record["sha256"] else f"{path.name} does not match its recorded sha256"
    if (st.st_mtime_ns, st.st_ctime_ns) != (record["mtime_ns"], record["ctime_ns"]):
        return f"{path.name} was modified after it was cached"
    return None


def write_manifest(folder: Path, source: dict) -> None:
    """Record every file under `folder` (by its path inside it) and where it came from, in its manifest.json."""
    files = {p.relative_to(folder).as_posix(): file_record(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p != folder / MANIFEST}
    write_json(folder / MANIFEST, {"source": source, "files": files})


def read_manifest(folder: Path) -> dict | None:
    """A folder's manifest, or None when it is missing or damaged."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        records = [manifest["source"], *manifest["files"].values()]
        if all(isinstance(r["sha256"], str) and all(isinstance(r[k], int) for k in ("size", "mtime_ns", "ctime_ns"))
               for r in records):
            return manifest
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def files_problem(folder: Path, manifest: dict, thorough: bool) -> str | None:
    """The first file of `folder` that is not what its manifest recorded, or None."""
    for name, record in manifest["files"].items():
        problem = file_problem(folder / name, record, thorough)
        if problem:
            return problem
    return None


def refresh_manifest(folder: Path, source: Path | None = None) -> None:
    """Record the current stat of files (and of the `source` file) that a thorough check found intact.

    Their content is as recorded but their stat changed (a copy, a `touch`): without
    this, every later quick check would fail and hash them again.
    """
    manifest = read_manifest(folder)
    records = [(folder / name, record) for name, record in manifest["files"].items()]
    for path, record in records + ([(source, manifest["source"])] if source else []):
        st = path.stat()
        record["mtime_ns"], record["ctime_ns"] = st.st_mtime_ns, st.st_ctime_ns
    write_json(folder / MANIFEST, manifest)
