"""Weights in huge pages: a model's tensors copied into one buffer that Linux backs with 2 MiB pages instead of 4 KiB.

Why it pays. Decoding one token at batch 1 reads every weight once (538 MB for
SmolLM2-135M in float32, ~150 MB in Q4_1) and does little else, so a step runs at the
memory bandwidth the CPU reaches while streaming them. Every address the CPU reads is
translated through the TLB, a small cache of page-table entries: on 4 KiB pages the
stream needs a new translation every 4 KiB (131,000 of them per float32 token, far more
than the TLB holds, so each is a page-table walk competing with the stream), on 2 MiB
pages one every 2 MiB (270 per token). Linux gives a process huge pages only where it
asks for them on most distributions (`/sys/kernel/mm/transparent_hugepage/enabled` says
`madvise`), and PyTorch's allocator does not ask: this maps one private anonymous
buffer, asks with `madvise(MADV_HUGEPAGE)`, and copies the tensors into it.

Measured on the course's 2-core Xeon (AVX-512), the float32 model's weights read as 211
separate matrix-vector products (the same bytes as its 121 fused ones): 31-33 ms a token
on 4 KiB pages, 25.3-25.5 ms in huge pages (16.5 -> 21.2 GB/s), alternated in one
process. Where the kernel gives no huge pages (THP set to `never`, another OS) the copy
is harmless: the same bytes, in one block.

The copy is paid once per process, and in a VM fresh huge pages are slow to touch the first
time (the host backs them as they are first written): a run that decodes a handful of tokens
starts later than it gains, one that decodes eagerly for long, or serves, gets it back; a
one-shot run through kept graphs does not (`defer_placement`).
"""

from __future__ import annotations

import mmap
import weakref
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
ALIGN = 64  # bytes: each tensor starts on a cache line, as the allocator would place it


def huge_page_region(nbytes: int) -> tuple[mmap.mmap | bytearray, int]:
    """Zeroed memory for nbytes the kernel is asked to back with huge pages, and the offset in it where they start on a
    2 MiB boundary (private: a forked process gets its own copy of what it writes)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux: ordinary memory
        return bytearray(nbytes), 0
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages refuses the advice: ordinary pages, same bytes
        pass
    # The first write to each huge page faults it in, and in a VM that can wait on the host to back it (0.7-1.6 s
    # for 540 MB on one core of the course's machine). Writing the zeros it holds anyway, as one parallel fill,
    # takes those faults on every core at once: 1.04-1.19 -> 0.90-0.92 s for the default model's weights.
    whole = torch.frombuffer(region, dtype=torch.uint8)
    whole.fill_(0)
    return region, -whole.data_ptr() % HUGE_PAGE


def movable(tensor: torch.Tensor) -> bool:
    """A plain CPU tensor whose bytes can be copied into the buffer (not oneDNN's opaque packed layout, not a meta
    or quantized tensor)."""
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_quantized
            and tensor.untyped_storage().nbytes() > 0)


def into_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, each with the same shape, strides, dtype and values, now in one huge-page buffer.

    Tensors that share a storage (views of one packed block, a weight held under two names)
    still share one after: the buffer holds each storage once, and every tensor is rebuilt
    on its copy at its own offset and strides. Tensors that cannot move come back as they are.
    """
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors if movable(t)}
    if not storages:
        return list(tensors)
    sizes = [-(-storage.nbytes() // ALIGN) * ALIGN for storage in storages.values()]
    region, start = huge_page_region(sum(sizes))
    copies = {}  # each storage's copy: a storage of its own over its bytes of the region (torch.export and
    for (key, storage), size in zip(storages.items(), sizes):  # torch.save treat views of one storage as one tensor)
        copy = torch.frombuffer(region, dtype=torch.uint8, count=storage.nbytes(), offset=start)
        copy.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        copies[key], start = copy.untyped_storage(), start + size
    return [torch.empty(0, dtype=t.dtype).set_(copies[t.untyped_storage().data_ptr()], t.storage_offset(), t.shape,
                                               t.stride()) if movable(t) else t for t in tensors]


def model_into_huge_pages(model: nn.Module) -> nn.Module:
    """Move every parameter and buffer of the model into one huge-page buffer, in place; the model.

    A parameter keeps its `nn.Parameter` (only its data moves), so weights tied by sharing
    one parameter (an embedding and the output head) stay tied.
    """
    named = [(module, kind, name, tensor) for module in model.modules()
             for kind in ("_parameters", "_buffers") for name, tensor in getattr(module, kind).items()
             if tensor is not None]
    unique = list({id(tensor): tensor for *_, tensor in named}.values())
    moved = dict(zip(map(id, unique), into_huge_pages([t.detach() for t in unique])))
    for module, kind, name, tensor in named:
        if kind == "_parameters":
            tensor.data = moved[id(tensor)]
        else:
            module._buffers[name] = moved[id(tensor)]
    return model


_DEFERRED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose copy waits for a decode that reads them


def defer_placement(model: nn.Module) -> nn.Module:
    """Leave `model` where it is until something decodes eagerly with it (`place_deferred`); the model.

    The copy is not free: on the course's VM a fresh 542 MB huge-page region took 1.67 s to
    fill (the host backs the guest's memory as it is first written), one reusing memory the
    process had just freed 0.10-0.12 s. A one-shot run through kept graphs does not get that
    back (`minillm.runtime.runner`, `minillm.speed.graph_store.PackagedStep`): the command line
    defers, and `ModelRunner` places the model only when its decode runs eagerly.
    """
    _DEFERRED.add(model)
    return model


def placement_deferred(model: nn.Module) -> bool:
    """Whether the loader left `model` out of huge pages for its user to decide (`defer_placement`) and nothing has
    placed it since: a one-shot run, which copies nothing that pays back only over many tokens."""
    return model in _DEFERRED


def place_deferred(model: nn.Module) -> None:
    """Copy a deferred model into huge pages now (`model_into_huge_pages`), once; any other model is left as it is."""
    if model in _DEFERRED:
        _DEFERRED.discard(model)
        model_into_huge_pages(model)


def huge_page_bytes(address: int) -> int | None:
    """How many bytes of the memory mapping that holds `address` the kernel backs with huge pages right now (Linux's
    `/proc/self/smaps`, its `AnonHugePages` line); None where there is no such file."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms offset ..."
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None


def transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode: "always", "madvise" (most systems: huge pages where a process asks)
    or "never"; None where the kernel has none."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()  # e.g. "always [madvise] never"
    except OSError:
        return None
    return setting[setting.index("[") + 1:setting.index("]")]
