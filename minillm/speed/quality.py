"""How much a model variant loses: perplexity on held-out text, and next-token KL and top-1 agreement
against a reference (lesson 14).

Perplexity exp(mean −log p(next token)) says how well a model predicts real text; it is
what llama.cpp's quantize table reports. It needs text the model did not write: the one
shipped here is "A Scandal in Bohemia" (Arthur Conan Doyle, 1891, public domain; the
Project Gutenberg edition, its header and licence boilerplate removed; ~12,000 tokens of
the default model's tokenizer), see `minillm/data/README.md`.

Perplexity moves little for small damage, so two sharper measures compare each variant
with the float32 model position by position: the KL divergence KL(p_ref ‖ p_variant) of
the next-token distributions (0 when equal), and how often both pick the same top token.

The text is cut into windows of `window` tokens, each read from scratch (no cache, no
overlap): every window's first token has no prediction, and later positions see at most
`window − 1` tokens back. The same windows are used for every variant, so they compare.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

HELD_OUT_TEXT = Path(__file__).resolve().parent.parent / "data" / "a_scandal_in_bohemia.txt"


def held_out_tokens(tokenizer, limit: int | None = None) -> list[int]:
    """The held-out text as token ids (the first `limit` of them when given)."""
    ids = tokenizer.encode(HELD_OUT_TEXT.read_text(encoding="utf-8"))
    return ids[:limit] if limit else ids


def windows(tokens: list[int], window: int) -> list[torch.Tensor]:
    """Non-overlapping windows [1, T] of the text (the last one shorter), each at least 2 tokens."""
    return [torch.tensor([tokens[i:i + window]]) for i in range(0, len(tokens) - 1, window)
            if len(tokens[i:i + window]) > 1]


@torch.no_grad()
def compare_models(models: dict, reference, tokens: list[int], window: int = 1024, desc: str = "evaluating") -> dict:
    """Perplexity of `reference` and each of `models` {name: model}, and each one's KL and top-1 agreement with it.

    Each window's reference log-probs are computed once and compared with every model
    while they are in memory (the full distributions of the whole text would not fit).
    Returns {name: {"perplexity", "kl", "top1_agreement", "tokens"}}, "reference" included.
    """
    names = ["reference", *models]
    nll = dict.fromkeys(names, 0.0)
    kl = dict.fromkeys(models, 0.0)
    agree = dict.fromkeys(models, 0)
    count = 0
    chunks = windows(tokens, window)
    for chunk in tqdm(chunks, desc=desc, unit="window", leave=False, disable=len(chunks) < 2):
        positions = torch.arange(chunk.shape[1])[None]
        targets = chunk[0, 1:]
        ref = F.log_softmax(reference(chunk, positions)[0, :-1].float(), dim=-1)  # [T - 1, V]
        nll["reference"] += -ref.gather(1, targets[:, None]).sum().item()
        ref_top = ref.argmax(dim=-1)
        for name, model in models.items():
            out = F.log_softmax(model(chunk, positions)[0, :-1].float(), dim=-1)
            nll[name] += -out.gather(1, targets[:, None]).sum().item()
            kl[name] += (ref.exp() * (ref - out)).sum().item()
            agree[name] += (out.argmax(dim=-1) == ref_top).sum().item()
        count += len(targets)
    result = {"reference": {"perplexity": float(torch.tensor(nll["reference"] / count).exp()), "tokens": count}}
    for name in models:
        result[name] = {"perplexity": float(torch.tensor(nll[name] / count).exp()), "kl": kl[name] / count,
                        "top1_agreement": agree[name] / count, "tokens": count}
    return result


__all__ = ["HELD_OUT_TEXT", "held_out_tokens", "windows", "compare_models"]
