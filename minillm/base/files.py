"""The cache folder under $MINILLM_HOME, and the three rules that let it be trusted, repaired and shared.

  * one writer at a time: writers hold `cache_lock()` (a file lock), readers never wait;
  * nothing half-written ever has a final name: files are built under a temporary name
    of the writing process (`temporary_path`) and renamed into place, and temporaries that
    an interrupted run left behind are removed by the next run that finds the cache idle;
  * every cache entry carries a `manifest.json` recording each file's size and sha256,
    so a damaged entry is noticed and rebuilt instead of producing garbage.

Model conversions (`minillm.model.loading`), fetched files (`minillm.model.fetch`) and
benchmark copies all keep these rules through the functions here.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt


class CacheError(ValueError):
    """The cache folder cannot be used; the message names the folder and the fix."""


def one_line(error: BaseException) -> str:
    """The first line of a library's error message: enough to say what went wrong."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


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
        raise CacheError(f"cannot write to the cache folder {home} ({one_line(e)}): "
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
        except CacheError:  # a read-only cache: leave it as it is
            return
        if lock_file is not None:
            lock_file.close()


def remove_unusable_siblings(folder: Path, usable) -> None:
    """Remove the cache entries beside `folder` (temporaries aside) that `usable(entry)` says no later run can load:
    those kept by another version of the code, which would otherwise pile up (hundreds of MB each) with every
    edit or upgrade. Called under the cache's lock, right after `folder` was kept."""
    for other in folder.parent.iterdir():
        if other != folder and TEMP_MARK not in other.name and not usable(other):
            remove(other)


def replace_folder(built: Path, final: Path) -> None:
    """Move a completed folder into place, replacing (and removing) any old one."""
    old = temporary_path(final)
    if final.exists():
        final.rename(old)
    built.rename(final)
    remove(old)
