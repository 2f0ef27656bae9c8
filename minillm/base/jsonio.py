"""The package's one JSON writer: strict JSON, written atomically.

Python's `json` writes a float NaN as the bare word `NaN` (and infinity as
`Infinity`): valid JavaScript, invalid JSON, rejected by strict parsers (jq, most
JSON libraries outside Python). A measurement can legitimately be undefined (an
acceptance rate when nothing was drafted, a ratio over zero), so every non-finite
float becomes `null`, which every parser reads as "no value". `allow_nan=False`
then makes any float that slipped past the conversion raise instead of writing
bad JSON.

`write_json` writes to a temporary file in the same folder and renames it over
the target, so a reader (or a crash halfway) never sees half a file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from .files import temporary_path


def finite_or_none(obj):
    """A copy of `obj` with every NaN / infinity replaced by None, through dicts, lists, tuples and dataclasses."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite_or_none(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(value) for value in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    """`json.dumps` that cannot emit NaN or Infinity (keyword arguments pass through, `allow_nan` excepted)."""
    kwargs.pop("allow_nan", None)
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


def write_json(path, obj, indent: int = 2) -> Path:
    """Write `obj` as strict JSON to `path` atomically: a temporary name in the same folder, then a rename."""
    path = Path(path)
    text = dumps(obj, indent=indent) + "\n"  # serialise first: a failure leaves the old file untouched
    temporary = temporary_path(path)
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def read_json(path):
    """Parse `path` strictly: NaN or Infinity in the file raise, as they would in any reader but Python's."""
    def reject(constant):
        raise ValueError(f"{path}: {constant} is not JSON; write an undefined value as null (minillm.base.jsonio)")

    return json.loads(Path(path).read_text(), parse_constant=reject)
