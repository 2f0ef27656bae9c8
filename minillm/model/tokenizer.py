"""Tokenizers behind one small protocol.

Every tokenizer the course uses answers the same calls:

    ids = tok.encode("text")                       # list[int]; the one special token added is a BOS the
                                                   # model needs at the start (Gemma), none for the others
    text = tok.decode(ids)                         # byte-level BPE: bytes joined, then UTF-8
    tok.token_bytes(id)                            # one token's own bytes (part of a character, maybe)
    tok.eos_token_id                               # int or None
    tok.apply_chat_template(messages)              # str, only where tok.chat_template is set

GPT-2's family uses tiktoken, with the BPE ranks that ship in the `openai-whisper`
sdist on PyPI (tiktoken's own download needs a host we cannot reach offline).
Llama-family checkpoints use Hugging Face `tokenizers`: from a `tokenizer.json`, or,
for a GGUF (the default model, Gemma 3), built here from the vocabulary (and merges)
stored in the GGUF metadata. Lesson 00 builds both BPEs by hand (`bpe.py`, plain Python, the
same ids) and SmolLM2's chat template (`chatml.py`, which renders it here).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..base.files import minillm_home, one_line
from .bpe import BYTE_OF, GPT2_PATTERN
from .chatml import render_chatml, renders_as_chatml
from .fetch import ModelLoadError, PackagedFile, fetch_packaged_file, read_json


class Tokenizer(Protocol):
    eos_token_id: int | None
    chat_template: str | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool, **extra) -> str:
    """Render a Hugging Face chat template: SmolLM2's in plain Python (`chatml.render_chatml`, lesson 00),
    any other with Jinja."""
    if renders_as_chatml(template, messages):
        return render_chatml(messages, add_generation_prompt)
    return render_jinja(template, messages, add_generation_prompt, **extra)


def render_jinja(template: str, messages: list[dict], add_generation_prompt: bool, **extra) -> str:
    """Render a chat template with Jinja2, sandboxed as transformers does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


class _ChatMixin:
    chat_template: str | None = None
    special_tokens_map: dict = {}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; run without --chat")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, **self.special_tokens_map)


# ---------------------------------------------------------------- GPT-2 (tiktoken)

GPT2_RANKS = PackagedFile(
    requirement="openai-whisper==20250625",
    archive_sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
    member="whisper/assets/gpt2.tiktoken",
    member_sha256="306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    source=True,
)
GPT2_EOS = 50256


class TiktokenTokenizer(_ChatMixin):
    """GPT-2's byte-level BPE via tiktoken (50257 tokens, <|endoftext|> = 50256)."""

    def __init__(self, encoding: tiktoken.Encoding, eos_token_id: int):
        self.encoding, self.eos_token_id = encoding, eos_token_id
        self.vocab_size = encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        return self.encoding.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token_id)


def gpt2_tokenizer() -> TiktokenTokenizer:
    path = fetch_packaged_file(GPT2_RANKS, minillm_home() / "gpt2" / "gpt2.tiktoken")
    encoding = tiktoken.Encoding(
        name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens={"<|endoftext|>": GPT2_EOS},
    )
    return TiktokenTokenizer(encoding, GPT2_EOS)


# ---------------------------------------------------------------- Hugging Face tokenizers


class HFTokenizerWrapper(_ChatMixin):
    """A `tokenizers.Tokenizer` plus the facts generation needs (EOS id, chat template)."""

    def __init__(self, tokenizer: HFTokenizer, eos_token_id: int | None, chat_template: str | None = None,
                 special_tokens_map: dict | None = None, bos_token_id: int | None = None, add_bos: bool = False):
        """add_bos: start every encoded text with `bos_token_id`. Gemma was trained that way and
        produces nonsense without it; SmolLM2 adds none."""
        self.tokenizer, self.eos_token_id, self.chat_template = tokenizer, eos_token_id, chat_template
        self.special_tokens_map = special_tokens_map or {}
        self.vocab_size = tokenizer.get_vocab_size()
        self.bos_token_id, self.add_bos = bos_token_id, add_bos and bos_token_id is not None

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: its text's UTF-8, or, where it is part of a character (its text alone is
        U+FFFD), the bytes its vocabulary entry spells: byte fallback's "<0xE2>", byte-level BPE's alphabet."""
        text = self.decode([token_id])
        piece = self.tokenizer.id_to_token(token_id)
        if "\ufffd" not in text or piece is None:
            return text.encode()
        if fallback := BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(fallback[1], 16)])
        if all(c in BYTE_OF for c in piece):
            return bytes(BYTE_OF[c] for c in piece)
        return text.encode()


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's token for one raw byte


# GGUF's `tokenizer.ggml.pre` names the split rule applied before BPE. "smollm" (like
# StarCoder's) first splits every digit on its own, then applies GPT-2's regex.
_GGUF_PRETOKENIZERS = {
    "smollm": [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "starcoder": [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "gpt-2": [pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "default": [pre_tokenizers.ByteLevel(add_prefix_space=False)],
}
GGUF_CONTROL_TOKEN = 3  # token_type value for special tokens such as <|im_end|>
GGUF_USER_TOKEN = 4  # token_type value for added tokens that are not special


def tokenizer_from_gguf_metadata(meta: dict) -> HFTokenizerWrapper:
    """Build the tokenizer that a GGUF file describes.

    `meta` holds the GGUF fields `tokenizer.ggml.*` (tokens, merges or scores, token_type,
    pre, bos/eos ids, add_bos_token) and `tokenizer.chat_template`. Byte-level BPE
    ('gpt2': SmolLM2) and Gemma's sentencepiece vocabulary ('llama' in a gemma3 file).
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = byte_level_bpe(meta)
    elif kind == "llama" and meta.get("general.architecture") == "gemma3":
        tok = gemma_bpe(meta)
    else:
        raise ValueError(f"unsupported GGUF tokenizer {kind!r} ({meta.get('general.architecture')}): "
                         f"minillm reads byte-level BPE ('gpt2') and Gemma 3's sentencepiece vocabulary")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == GGUF_CONTROL_TOKEN])
    # User-defined tokens (Gemma's "[multimodal]", runs of tabs, ...) are matched whole, as llama.cpp does;
    # those the vocabulary spells otherwise (Gemma's runs of spaces, looked up as "▁"s) are left to it.
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == GGUF_USER_TOKEN and t in vocab])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    specials = {"eos_token": tokens[eos] if eos is not None else None, "bos_token": tokens[bos] if bos is not None else None}
    return HFTokenizerWrapper(tok, eos, meta.get("tokenizer.chat_template"), specials, bos,
                              bool(meta.get("tokenizer.ggml.add_bos_token", False)))


def byte_level_bpe(meta: dict) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRETOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {', '.join(_GGUF_PRETOKENIZERS)}")
    vocab = {tok: i for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(_GGUF_PRETOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    return tok


def gemma_bpe(meta: dict) -> HFTokenizer:
    """Gemma's tokenizer: BPE over "▁"-for-space text with byte fallback, as transformers builds it from a GGUF.

    The GGUF lists no merges, so they are rebuilt from the vocabulary: every split of a
    token into two tokens is a merge, ranked by where the merged token stands in the file
    (Gemma's scores do not follow the merge order; the file order does). Tokens made of
    several spaces are stored with real spaces, and looked up as "▁"s.
    """
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in meta["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for rank, token in enumerate(tokens):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges.extend((rank, -len(left), -len(right), left, right) for left, right in pairs)
    merges.sort()  # by the merged token's rank, then longer left pieces first (transformers' generate_merges)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=True,
                                 unk_token=tokens[meta.get("tokenizer.ggml.unknown_token_id", 3)], byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def tokenizer_from_folder(folder: Path, model_type: str) -> Tokenizer | None:
    """The tokenizer of a Hugging Face checkpoint folder, or None if it ships none.

    A file that is there but unreadable is an error naming it, not a silent fallback.
    """
    if model_type == "gpt2":
        return gpt2_tokenizer()
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.exists():
        return None
    config_file = folder / "tokenizer_config.json"
    config = read_json(config_file) if config_file.exists() else {}
    try:
        tok = HFTokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the tokenizers library raises a bare Exception for bad files
        raise ModelLoadError(f"{tokenizer_file} is not a valid tokenizer file ({one_line(e)}): "
                             f"fetch the checkpoint again") from None
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise ModelLoadError(f"{config_file} has eos_token {eos!r}: it must be the token's text")
    eos_id = tok.token_to_id(eos) if eos else None
    template = config.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template is None and template_file.exists():
        try:
            template = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"cannot read {template_file} ({one_line(e)}): fix it or fetch it again") from None
    bos = config.get("bos_token")
    bos = bos if isinstance(bos, str) else None
    return HFTokenizerWrapper(tok, eos_id, template, {"eos_token": eos, "bos_token": bos},
                              tok.token_to_id(bos) if bos else None, bool(config.get("add_bos_token", False)))
