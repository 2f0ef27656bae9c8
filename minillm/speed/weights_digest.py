"""The weights' digest that keys a kept graph: every byte hashed on every core, or remembered from an earlier run.

A kept graph (`minillm.speed.graph_store`) is found by a key that includes a sha256 of the
model's weights, since a package holds copies of them re-laid out for its kernels: a
package built from other weights would compute with those. Hashing the default model's
538 MB costs 0.2 s on two cores, every start. But a model loaded from one of minillm's own
conversions (`minillm.model.loading`), whose files are unchanged since their sha256 were
recorded (size, mtime and ctime, as git's index checks them), with the same options and the
same package source, is the same bytes as the last time: the loader gives such a model an
identity (`remember_across_runs`), the first run that hashes it records the digest under
$MINILLM_HOME/digests, and later runs start from the record. The record is bound to the
tensors as they were loaded: a model changed after loading (a swap, an in-place edit, a
copy) is hashed again, and never writes a record.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..base.files import minillm_home
from ..base.jsonio import write_json
from .package_layout import model_tensors

HASH_PIECE = 16 << 20  # bytes: the weights are hashed in pieces this size, on every core (`weights_digest`)


def tensors_signature(tensors: dict[str, torch.Tensor]) -> tuple:
    """Each tensor's name, storage and version counter, which every in-place write bumps: equal signatures, equal
    bytes, within one process."""
    # Tensors made under torch.inference_mode keep no version counter: for them the storage alone is the signature.
    return tuple((name, t.data_ptr(), -1 if t.is_inference() else t._version) for name, t in sorted(tensors.items()))


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over every parameter's and buffer's name, dtype, shape and bytes (0.25 s for the default model's 538 MB
    on two cores).

    The bytes are hashed in 16 MiB pieces on every core (hashlib lets go of the GIL while it hashes),
    and the digest is taken over the pieces' digests in order: one core hashes 1 GB/s, so a start that
    looks for its kept graph spent 0.48 s here on one. Kept on the module with a signature of its
    tensors (`tensors_signature`): asked again, it hashes again only if a tensor was replaced (a
    quantization swap) or written to. Remembered across runs where the loader knows the bytes
    (`remember_across_runs`).
    """
    tensors = model_tensors(module)
    signature = tensors_signature(tensors)
    kept = module.__dict__.get("_weights_sha256")
    if kept and kept[0] == signature:
        return kept[1]
    headers, pieces = [], []  # per tensor: its description, then the index range of its pieces
    for name in sorted(tensors):
        t = tensors[name].detach()
        data = memoryview(t.contiguous().cpu().view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        first = len(pieces)
        pieces += [data[start:start + HASH_PIECE] for start in range(0, len(data), HASH_PIECE)]
        headers.append((f"{name} {t.dtype} {tuple(t.shape)}".encode(), first, len(pieces)))
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        piece_digests = list(pool.map(lambda piece: hashlib.sha256(piece).digest(), pieces))
    digest = hashlib.sha256()
    for header, first, end in headers:
        digest.update(header)
        digest.update(b"".join(piece_digests[first:end]))
    module.__dict__["_weights_sha256"] = (signature, digest.hexdigest())
    remembered = module.__dict__.get("_weights_identity")
    if remembered and remembered[0] == signature:  # the tensors as they were loaded: the next run need not hash
        record = record_path(remembered[1])
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            write_json(record, {"weights_sha256": digest.hexdigest()})
        except OSError:  # a read-only cache: the next run hashes again
            pass
    return digest.hexdigest()



def record_path(identity: str) -> Path:
    return minillm_home() / "digests" / f"{identity}.json"


def remember_across_runs(module: torch.nn.Module, identity: str) -> None:
    """Bind `identity` (a sha256 of everything the loaded bytes depend on) to the module's tensors as they are now:
    the digest recorded for it by an earlier run is taken as the module's, and `weights_digest` records one if none
    is."""
    signature = tensors_signature(model_tensors(module))
    module.__dict__["_weights_identity"] = (signature, identity)
    try:
        recorded = json.loads(record_path(identity).read_text())["weights_sha256"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or damaged: hashed when a key is needed
        return
    if isinstance(recorded, str):
        module.__dict__["_weights_sha256"] = (signature, recorded)


__all__ = ["HASH_PIECE", "remember_across_runs", "tensors_signature", "weights_digest"]
