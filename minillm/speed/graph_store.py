"""Compiled graphs kept on disk: each fixed-shape step built once as an AOTInductor package, loaded in seconds.

`torch.compile` (`minillm.speed.compile`) builds its graphs inside the process that runs
them: every new process traces, lowers, autotunes and compiles C++ again, a minute or more
for the default model on two cores, before its first decode step. What that work produces
depends only on the model, the shapes and the machine, so it can be kept. Three ways were
measured:

    torch.compile's own caches      the next process still traces the model with Dynamo and
                                    re-runs freezing; frozen graphs bypass parts of the cache
                                    (on a 2-core AMD EPYC, in an earlier session, a second
                                    `--compile` process with warm caches took 135 s, the first 139)
    ONNX Runtime's saved graphs     loads fast, but its matmuls are the library's, not kernels
                                    generated for each weight's shape: no faster than eager
    AOTInductor packages (kept)     `torch.export` gives one graph, AOTInductor (`aot_compile`)
                                    turns it into a shared library plus its constants (the
                                    weights, prepacked for the generated matmul kernels); a
                                    later process loads it and calls it: no tracing, no
                                    compiling, no Python between the kernels

One package per step shape (`StepShape`, in `minillm.speed.step_shapes`): the batch, the tokens it feeds (1 to decode, a
chunk to prefill or verify), the cache length, and how many positions get logits; and one for
the engine's decode step over the paged pool (`PagedShape`), whose sizes stay symbolic. Each is
an entry of the cache under $MINILLM_HOME (`minillm.base.files`) keyed by everything that
changes the code it holds (`graph_key`): the weights' digest, the model's config and dtype,
the shape, the compiler settings, the source of the modules the forward runs, the torch
version and the CPU's instruction set. An entry is built under a temporary name and renamed
into place, with a manifest of its files checked before every load: a damaged or partly
written package is rebuilt, never loaded. Two processes that need the same package take
turns (the cache's lock): the second finds it built.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..base.files import (cache_lock, minillm_home, one_line, remove, remove_unusable_siblings, replace_folder,
                          temporary_path, verify_requested)
from ..base.jsonio import write_json
from ..base.machine import cpuinfo_field
from ..base.manifest import file_record, files_problem, read_manifest, refresh_manifest, write_manifest
from .cpp_build import faster_package_build
from .huge_pages import into_huge_pages, placement_deferred
from .package_layout import MODEL_FILES, WEIGHT_FILES, WEIGHTS_CONFIG, model_tensors, write_package
from .step_shapes import PagedShape, StepShape
from .weights_digest import weights_digest

PACKAGE = "package"  # what AOTInductor built, laid out as its `.pt2` archive unpacks (a load extracts nothing)
STEP = f"{PACKAGE}/step"
CONSTANTS = f"{STEP}/{MODEL_FILES}/{WEIGHTS_CONFIG}"  # AOTInductor's: constant -> its file
WEIGHTS = f"{STEP}/{WEIGHT_FILES}"  # one file per constant (or per group sharing a storage)
SHARED = "shared.json"  # ours: the constants taken from the live model at load (constant -> the model's tensor)
KEY_FILE = "key.json"
# The source folders of everything a step's forward runs (the model, its cache, the speed swaps):
# an edit to any of them changes the generated code, so it changes every key.
SOURCE_FOLDERS = ("model", "cache", "speed")
# ...but for the files that turn text into ids and back: nothing of theirs is in a graph.
TEXT_ONLY = ("model/bpe.py", "model/chatml.py", "model/tokenizer.py")


class PackagedStep:
    """A loaded package: call it with the step's tensors in `CacheStep.forward`'s order, logits [B, K, V] back.

    Its constants are given to the library as tensors it does not own (`user_managed`): the
    model's own weights where the package uses them unchanged (`package_layout.write_package`), and
    the rest (weights Inductor re-laid out for its matmul kernels, RoPE tables) read from
    their files into huge pages (`minillm.speed.huge_pages`: a step streams them all every
    token, 9-13% faster for the int8 and Q4_1 steps than from the files' 4 KiB pages on the
    course's Xeon). The copy is paid at load: on the 2-core AMD EPYC 0.8-1.0 s for the float32
    step's 540 MB and 0.3 s for int8's, where the steps ran no faster for it (median of six
    64-token runs, alternated: float32 41.9 against 39.8 tok/s, int8 84.9 against 82.9, Q4_1
    79.8 against 80.1). A one-shot run (the command line: `placement_deferred`) skips it and
    reads the files' pages as they are mapped; a server or a notebook, which decodes for long,
    makes it.
    The loader's own call re-reads the package's input spec and flattens the arguments
    with pytree on every call; this passes the flat tensor list straight to the library.
    """

    def __init__(self, folder: Path, model: torch.nn.Module):
        self.folder = folder
        # The loader takes an unpacked package folder as it is; given the `.pt2` archive it would first
        # extract it, weights included, to a temporary folder on every load.
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(folder / PACKAGE), "model", False, 1, -1)
        shared, live, files = json.loads((folder / SHARED).read_text()), model_tensors(model, every_name=True), {}
        constants = {}
        for name, (file, shape, stride, offset) in json.loads((folder / CONSTANTS).read_text()).items():
            if name in shared:
                tensor = live[shared[name]].detach()
                if list(tensor.shape) != shape or list(tensor.stride()) != stride:
                    raise ValueError(f"the model's {shared[name]} is {list(tensor.shape)}, the package's {shape}")
                constants[name] = tensor
            else:
                if file not in files:
                    files[file] = torch.load(folder / WEIGHTS / file, weights_only=True, mmap=True)
                constants[name] = files[file].as_strided(shape, stride, offset)
        if not placement_deferred(model):  # a one-shot run reads them where they are mapped (the class docstring)
            mapped = [name for name in constants if name not in shared]
            constants.update(zip(mapped, into_huge_pages([constants[name] for name in mapped])))
        self.loader.load_constants(constants, False, True, True)  # active set, every constant, user-managed
        # User-managed: the library runs on these tensors as they are. Held here too, so that the model's tensors stay
        # alive for the package even if the model is later moved (into huge pages, `place_deferred`).
        self.constants = constants
        self.build_seconds = json.loads((folder / KEY_FILE).read_text()).get("build_seconds")  # the one-time cost

    def __call__(self, *args) -> torch.Tensor:
        """The step's arguments in its module's order (per-layer lists as lists; a None input left out)."""
        flat = [t for arg in args if arg is not None for t in (arg if isinstance(arg, list) else [arg])]
        return self.loader.boxed_run(flat)[0]


@functools.cache
def source_digest() -> str:
    """sha256 of the package source the traced forward comes from (`SOURCE_FOLDERS` but `TEXT_ONLY`), once
    per process."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for folder in SOURCE_FOLDERS for p in (root / folder).rglob("*.py")
                       if p.relative_to(root).as_posix() not in TEXT_ONLY):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def machine_code() -> dict:
    """What the generated C++ is compiled for: torch's build, its CPU instruction set, the CPU's flags."""
    flags = cpuinfo_field("flags", "Features") or platform.processor()
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "python": platform.python_version()}


def graph_key(model, shape: StepShape | PagedShape, settings: dict) -> dict:
    """Everything that changes a package's code or constants, as a readable dict (hashed for the folder name).

    model: the model the graph is made from (its weights, config, dtype and device).
    """
    return {"weights_sha256": weights_digest(model), "config": asdict(model.config), "dtype": str(model.dtype),
            "device": str(model.device), "shape": asdict(shape), "settings": settings,
            "source_sha256": source_digest(), **machine_code()}


def kept_problem(model, shape: StepShape | PagedShape, settings: dict) -> str | None:
    """Why the package for this model, shape and settings cannot be loaded as it is ("missing", or what is
    damaged), or None when an intact one is on disk (nothing is built or loaded).

    With no package of this shape at all (every eager start before a first build) it says so without
    hashing the weights (a few hundred ms for the default model)."""
    if not any((minillm_home() / "graphs").glob(f"{shape.name}-*")):
        return "missing"
    folder = entry_folder(graph_key(model, shape, settings), shape)
    problem = entry_problem(folder)
    return problem if problem in (None, "missing") else f"{folder.name}: {problem}"


def package_bytes(folder: Path) -> int:
    """The size of an entry's package on disk (its library, its constants, its metadata)."""
    return sum(p.stat().st_size for p in (folder / PACKAGE).rglob("*") if p.is_file())


def entry_folder(key: dict, shape: StepShape | PagedShape) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return minillm_home() / "graphs" / f"{shape.name}-{digest}"


def entry_problem(folder: Path) -> str | None:
    """Why a package entry cannot be loaded as it is, or None (stat checks; hashes when MINILLM_VERIFY=1)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "missing" if not folder.exists() else "its manifest is missing or damaged"
    thorough = verify_requested()
    problem = files_problem(folder, manifest, thorough)
    if problem and not thorough:  # a changed stat: settle it by hashing
        problem = files_problem(folder, manifest, thorough=True)
        if problem is None:
            refresh_manifest(folder)
    return problem


def load_or_build(model, make_step, shape: StepShape | PagedShape, key: dict, build_settings,
                  progress=None) -> PackagedStep:
    """The package for `shape`: loaded when its entry is intact, built (and kept) when it is missing or damaged.

    model: the live model the package takes its shared weights from; make_step: gives the module to
    export (`shape.module`'s; called only to build); build_settings: a context manager factory setting the compiler's
    options while it builds; progress: called with a short status line.
    """
    folder = entry_folder(key, shape)
    problem = entry_problem(folder)
    if problem is None:
        try:
            return PackagedStep(folder, model)
        except Exception as e:  # a package that passes its manifest but will not load: built by another torch
            problem = f"it does not load ({one_line(e)})"
    with cache_lock():
        if entry_problem(folder) is None:  # another process built it while we waited
            return PackagedStep(folder, model)
        if problem != "missing":
            print(f"minillm: compiled graph {folder.name} is unusable ({problem}): rebuilding it", file=sys.stderr)
        build_entry(model, make_step(), shape, key, folder, build_settings, progress)
    return PackagedStep(folder, model)


def build_entry(model, step_module, shape: StepShape | PagedShape, key: dict, folder: Path, build_settings,
                progress=None) -> None:
    """Export the step at `shape`, compile it to a package in a temporary folder, record it, rename it into place.

    model: the live model (its weights stay out of the package); step_module: the module traced."""
    from torch._inductor import aot_compile

    built = temporary_path(folder)
    built.mkdir(parents=True)
    try:
        inputs = shape.example_inputs(model.config, model.dtype, model.device)
        start = time.perf_counter()
        if progress:
            progress(f"{shape.name}: tracing")
        with torch.no_grad():
            program = torch.export.export(step_module, inputs, strict=False,
                                          dynamic_shapes=shape.dynamic_shapes(model.config))
        if progress:
            progress(f"{shape.name}: compiling")
        # Each constant in a file of its own beside the library, not in the library's data section; the C++ wrapper
        # compiled beside the kernels (`cpp_build`); the files laid out as the loader reads them (`package_layout`).
        settings = {"aot_inductor.package": True, "aot_inductor.package_constants_in_so": False,
                    "aot_inductor.package_constants_on_disk_format": "pickle_weights"}
        args, kwargs = program.example_inputs
        with build_settings(), faster_package_build():
            files = aot_compile(program.module(check_guards=False), args, kwargs, options=settings)
        write_json(built / SHARED, write_package(files, built / STEP, model))
        write_json(built / KEY_FILE, {**key, "build_seconds": round(time.perf_counter() - start, 1)})
        write_manifest(built, file_record(built / KEY_FILE))
        replace_folder(built, folder)
    finally:
        remove(built)
    remove_entries_of_other_code(folder)


def remove_entries_of_other_code(folder: Path) -> None:
    """Remove the entries beside `folder` built from other code (another package source, torch, Python or CPU):
    no later run here loads them, and each is hundreds of MB."""
    this_code = built_by(folder)
    remove_unusable_siblings(folder, lambda other: built_by(other) == this_code)


def built_by(folder: Path) -> dict | None:
    """The code an entry's package was built from and for (the package source, torch, Python, the CPU's
    instruction set), or None where its key cannot be read: an entry whose code differs is never loaded again."""
    try:
        key = json.loads((folder / KEY_FILE).read_text())
        return {name: key[name] for name in ("source_sha256", *machine_code())}
    except (OSError, ValueError, KeyError, TypeError):
        return None


__all__ = ["PackagedStep", "entry_folder", "entry_problem", "graph_key", "kept_problem", "load_or_build",
           "machine_code", "package_bytes", "source_digest", "weights_digest"]
