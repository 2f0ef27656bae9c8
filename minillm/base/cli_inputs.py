"""The command line's text, file and JSON inputs: a prompt's bytes, a prompts file, a JSON schema given inline or as
a file.

Each reader turns a bad input into one ValueError line naming the file or flag and what is wrong, which
`run_command` prints without a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path


def command_line_text(text: str, flag: str) -> str:
    """`text` as given after `flag`, refused in one line unless it is UTF-8. Python hands undecodable argument
    bytes over as lone surrogates (PEP 383), which a tokenizer rejects with a message about its own types."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00  # PEP 383: an undecodable byte b arrives as the code point 0xDC00 + b
        raise ValueError(f"{flag} is not valid UTF-8 text (character {e.start} is the byte 0x{byte:02X}): pass "
                         "UTF-8, e.g. convert with iconv -t UTF-8") from None
    return text


def read_prompts_file(path: str) -> list[str]:
    """Prompts from a file, by its name's ending (any case):

    .jsonl   one JSON object with a "prompt" field per line
    .json    a JSON list of strings or of such objects
    other    one prompt per line (blank lines skipped)

    UTF-8, with or without a byte-order mark.
    """
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise ValueError(f"cannot read --prompts-file {path}: {e.strerror}") from None
    suffix = Path(path).suffix.lower()
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if suffix == ".jsonl":
        return [_prompt_of(_parse_json(line, f"{path} line {n}"), f"{path} line {n}") for n, line in lines]
    if suffix == ".json":
        items = _parse_json(text, path)
        if not isinstance(items, list):
            raise ValueError(f"{path} must hold a JSON list of prompts (strings or {{\"prompt\": ...}} objects)")
        return [_prompt_of(item, f"{path} item {i}") for i, item in enumerate(items)]
    return [line for _, line in lines]


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON ({e.msg})") from None


def _prompt_of(item, where: str) -> str:
    prompt = item.get("prompt") if isinstance(item, dict) else item
    if not isinstance(prompt, str):
        raise ValueError(f"{where} is not a JSON object with a \"prompt\" field (a string), nor a string")
    return prompt


def schema_text(value: str | None) -> str | None:
    """--json-schema's value as JSON text: the value itself, or the contents of the file it names."""
    if value is None:
        return None
    where = "--json-schema"
    if not value.lstrip().startswith("{") and Path(value).is_file():
        where = f"--json-schema file {value}"
        try:
            value = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {where}: {getattr(e, 'strerror', None) or e}") from None
    elif not value.lstrip().startswith("{"):
        raise ValueError(f"--json-schema {value!r} is neither a JSON object nor a file: pass the schema as JSON "
                         "text or the path of a file holding it")
    if not isinstance(_parse_json(value, where), dict):
        raise ValueError(f"{where} must hold a JSON object (a JSON schema)")
    return value
