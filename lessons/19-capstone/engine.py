"""The capstone: a whole LLM inference engine in one file, with nothing but torch.

Read it top to bottom; each part is a lesson of the course, written again from scratch:

    1. Model       a Llama-family forward (RMSNorm, RoPE, grouped-query attention, SwiGLU)   lessons 01, 17
    2. PagedKV,    a paged KV cache: one pool of fixed-size blocks, a free list, and a block   lessons 06, 12
       BlockPool   table per request saying which blocks hold its keys, in order
    3. sample      greedy, temperature, top-k, top-p, each request with its own seeded stream  lessons 02, 03
    4. propose     prompt lookup: draft tokens by copying what followed the last n-gram        lessons 08, 11
    5. Engine      continuous batching: requests arrive, are prefilled, join the running       lesson 12
                   batch, leave when done, their blocks back on the free list

One forward serves every kind of work. Each running request feeds the tokens the pool holds no
keys for yet (its whole prompt when it is new, one token when it decodes, one token and a draft
when it speculates); all requests' tokens are packed back to back in one row of N tokens, with no
padding. In every layer the new keys are written into the pool at their slots first, then each
request's queries attend over the blocks of its own table. Everything is float32, so the greedy
tokens equal the package's (`minillm.generate`) token for token: tests/test_19_capstone.py.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# ================================================================== 1. The model


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim: Llama's norm (no mean subtracted, no bias)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, head_dim]: position p turns dim pair (i, i + head_dim/2) by p * theta^(-2i/head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    angles = torch.arange(length).float()[:, None] * inv_freq  # [length, head_dim/2]
    return torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x [N, heads, hd] * cos + rotate_half(x) * sin, cos and sin [N, 1, hd]. A score q·k then
    depends on how far apart the two tokens are, not on where they are."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one request: q [T, H, hd] over its keys k, v [L, KV, hd]; visible bool [T, L].

    Grouped-query attention: H query heads share KV key heads, query head h reading key head
    h // (H / KV), so each key head is repeated for its group. Returns [T, H, hd].
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, hd]
    scores = torch.einsum("thd,lhd->htl", q, k) / math.sqrt(q.shape[-1])  # [H, T, L]
    weights = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
    return torch.einsum("htl,lhd->thd", weights, v)  # [T, H, hd]


@dataclass
class Feed:
    """One request's part of a packed forward: rows start:end of the row, its block table, its keys."""

    start: int
    end: int
    blocks: torch.Tensor  # long [nb]: the blocks holding its keys, in order
    num_keys: int  # keys it attends over, this step's included
    visible: torch.Tensor  # bool [T, num_keys]: query t (position num_keys - T + t) sees keys up to its own


class Model:
    """A Llama-family decoder (SmolLM2, Llama, Qwen2) run from a plain dict of tensors.

    The names are minillm's (`model.state_dict()`): per layer i, `blocks.{i}.norm1.weight`,
    `attn.qkv.weight` (q, k and v stacked: [(H + 2 KV) * hd, d]), `attn.proj.weight`,
    `norm2.weight`, `mlp.fc.weight` (gate and up stacked: [2 * ff, d]), `mlp.proj.weight`; then
    `norm_f.weight`, `tok_emb.weight` and `lm_head.weight` (one tensor when the embeddings are tied).
    """

    def __init__(self, weights: dict[str, torch.Tensor], *, n_layer: int, n_head: int, n_kv_head: int,
                 head_dim: int, norm_eps: float, rope_theta: float, context_length: int):
        self.w, self.n_layer, self.eps = weights, n_layer, norm_eps
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.context_length, self.vocab_size = context_length, weights["lm_head.weight"].shape[0]
        self.cos, self.sin = rope_tables(head_dim, rope_theta, context_length)  # looked up, not recomputed

    @classmethod
    def from_minillm(cls, model) -> Model:
        """The weights and shapes of a loaded minillm model (`minillm.load_model`, `tiny_pair`), as float32."""
        c = model.config
        if (c.norm, c.positions, c.mlp, c.block, c.bias) != ("rmsnorm", "rope", "swiglu", "pre", False) \
                or c.qk_norm or c.sliding_window or c.rotary_dim or c.rope_long_factor or c.embed_scale:
            raise ValueError("the capstone runs Llama-family models (RMSNorm, RoPE, SwiGLU, pre-norm, no biases "
                             "but q/k/v's); use the package for the other families")
        weights = {name: t.detach().float() for name, t in model.state_dict().items()}
        return cls(weights, n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.kv_heads, head_dim=c.head_size,
                   norm_eps=c.norm_eps, rope_theta=c.rope_theta, context_length=c.context_length)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))  # Qwen2 has a q/k/v bias

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, feeds: list[Feed],
                kv: PagedKV, logit_rows: torch.Tensor) -> torch.Tensor:
        """tokens, positions, slots: long [N], every request's new tokens back to back, and the pool
        slot each one's keys go to. Returns float32 logits [R, vocab] at the R rows `logit_rows` (the
        LM head is the widest matmul: only rows whose next token is wanted pay for it)."""
        N, H, KV, hd = len(tokens), self.n_head, self.n_kv_head, self.head_dim
        x = self.w["tok_emb.weight"][tokens]  # [N, d]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [N, 1, hd]
        for i in range(self.n_layer):
            p = f"blocks.{i}."
            h = rms_norm(x, self.w[p + "norm1.weight"], self.eps)
            q, k, v = self.linear(h, p + "attn.qkv").view(N, H + 2 * KV, hd).split([H, KV, KV], dim=1)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # q [N, H, hd]; k, v [N, KV, hd]
            kv.write(i, slots, k, v)  # every request's new keys stored before anyone reads: same-step sharing works
            y = torch.cat([attend(q[f.start:f.end], *kv.read(i, f.blocks, f.num_keys), f.visible) for f in feeds])
            x = x + self.linear(y.view(N, H * hd), p + "attn.proj")  # [N, d]
            gate, up = self.linear(rms_norm(x, self.w[p + "norm2.weight"], self.eps), p + "mlp.fc").chunk(2, -1)
            x = x + self.linear(F.silu(gate) * up, p + "mlp.proj")  # SwiGLU: [N, ff] -> [N, d]
        x = rms_norm(x[logit_rows], self.w["norm_f.weight"], self.eps)  # [R, d]
        return self.linear(x, "lm_head")  # [R, vocab]


# ================================================================== 2. The paged KV cache


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` tokens (the last one may be part full)."""
    return -(-tokens // block_size)


class PagedKV:
    """The keys and values themselves: k, v [n_layer, num_blocks, block_size, KV, hd].

    A token at position p of a request lives in block table[p // block_size] at offset
    p % block_size, its slot (its row in the flattened pool) table[p // bs] * bs + p % bs.
    """

    def __init__(self, model: Model, num_blocks: int, block_size: int):
        shape = (model.n_layer, num_blocks, block_size, model.n_kv_head, model.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, KV, hd] into their slots long [N]."""
        self.k[layer].flatten(0, 1)[slots] = k
        self.v[layer].flatten(0, 1)[slots] = v

    def read(self, layer: int, blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's first n keys and values, gathered block by block: [n, KV, hd] each."""
        return self.k[layer][blocks].flatten(0, 1)[:n], self.v[layer][blocks].flatten(0, 1)[:n]


class BlockPool:
    """The free list: which of the pool's blocks are free. A stack, so the block freed last is handed
    out first. It knows nothing of keys; the engine asks it for blocks and gives them back."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.allocations = 0  # blocks handed out over the pool's life

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        self.allocations += 1
        return self.free_blocks.pop()

    def free(self, block: int) -> None:
        self.free_blocks.append(block)

    def admit(self, tokens: list[int]) -> tuple[list[int], int]:
        """A new request's first blocks, and how many of its tokens they already hold keys for.
        Nothing here: every request starts from an empty table (exercise 3 shares prefixes)."""
        return [], 0


# ================================================================== 3. Choosing tokens


@dataclass(frozen=True)
class Params:
    """How a request chooses its tokens and how many it may write. temperature 0 means greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None


def warp(logits: torch.Tensor, params: Params) -> torch.Tensor:
    """Temperature, then top-k, then top-p (transformers' order) on logits [V]; removed tokens get -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < len(logits):
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k).values[-1], -math.inf)
    if params.top_p < 1.0:  # drop the least likely tokens whose mass stays within 1 - top_p (never the best)
        ordered, order = torch.sort(logits)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - params.top_p
        drop[-1] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), -math.inf)
    return logits


def sample(logits: torch.Tensor, params: Params, generator: torch.Generator | None) -> int:
    """The next token from logits [V]: the argmax (the first on ties), or a draw from the warped
    distribution by inverting its CDF with one uniform number from the request's own generator."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = warp(logits, params).softmax(-1)
    cdf = probs.cumsum(-1)
    u = torch.rand(1, generator=generator)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(token, int(probs.nonzero()[-1]))  # rounding may land past the last token with mass


# ================================================================== 4. Prompt lookup


def propose(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Up to k draft tokens: find the last n tokens earlier in the context (longest n, latest match
    first) and copy what followed them. Free to make, and right whenever the answer quotes its input."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


# ================================================================== 5. The engine


@dataclass
class Request:
    """One request's whole life: its tokens, where its keys are, how it chooses tokens and stops."""

    id: int
    prompt: list[int]
    params: Params
    processors: tuple = ()  # each (logits [V], tokens so far) -> logits, applied before choosing
    stop: Callable[[str], str | None] | None = None  # the text so far -> the final text to end with, or None
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    blocks: list[int] = field(default_factory=list)  # its block table
    computed: int = 0  # tokens whose keys are in the pool: it feeds tokens[computed:] next
    generator: torch.Generator | None = None
    finish_reason: str | None = None  # "eos", "length" or "stop"
    text: str | None = None  # what it generated, as text (an ending EOS token not in it, as in the package)
    drafted: int = 0
    accepted: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def speculates(self) -> bool:  # greedy, no processors: a draft token kept is the argmax, exactly
        return self.params.temperature == 0 and not self.processors


class Engine:
    """Continuous batching over the paged cache. Every `step()` is one forward:

        schedule   running requests first, each given the blocks its next tokens need (when the pool
                   is dry a draft shrinks first, a guess being cheaper to drop than a request's place;
                   then the most recently admitted is preempted: its blocks freed, recomputed later);
                   then waiting requests join while the batch and the free blocks allow
        pack       every request's new tokens back to back, with positions and pool slots
        forward    one packed forward; logits at each request's last token (all k + 1 when verifying)
        advance    each request appends its token(s); a draft keeps its longest prefix the model agrees
                   with, plus the model's own next token, and its rejected tail is rolled back; a
                   finished request leaves and its blocks go back on the free list

    `history` records every step (who fed how many tokens, the block tables, free blocks, time),
    so a run can be drawn afterwards.
    """

    def __init__(self, model: Model, *, num_blocks: int = 256, block_size: int = 16, max_batch: int = 16,
                 lookup: int = 0, eos_token_id: int | None = None, tokenizer=None, pool: BlockPool | None = None):
        self.model, self.lookup, self.max_batch = model, lookup, max_batch
        self.eos_token_id, self.tokenizer = eos_token_id, tokenizer
        self.pool = pool or BlockPool(num_blocks, block_size)
        self.kv = PagedKV(model, self.pool.num_blocks, self.pool.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.history: list[dict] = []
        self.next_id = 0

    def add_request(self, prompt: list[int], params: Params = Params(), processors=(), stop=None) -> Request:
        longest = len(prompt) + params.max_new_tokens
        capacity = self.pool.num_blocks * self.pool.block_size
        if not prompt or longest > min(capacity, self.model.context_length):
            raise ValueError(f"a request of {len(prompt)} + {params.max_new_tokens} tokens does not fit: the pool "
                             f"holds {capacity}, the model knows {self.model.context_length} positions")
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        request = Request(self.next_id, list(prompt), params, tuple(processors), stop, list(prompt),
                          generator=generator)
        self.next_id += 1
        self.waiting.append(request)
        return request

    # ------------------------------------------------------------------ schedule

    def reserve(self, request: Request, new_tokens: int) -> bool:
        """Give the request the blocks for `new_tokens` more keys; False if the pool has too few free."""
        needed = blocks_for(request.computed + new_tokens, self.pool.block_size) - len(request.blocks)
        if needed > self.pool.num_free:
            return False
        request.blocks += [self.pool.allocate() for _ in range(needed)]
        return True

    def release(self, request: Request, keep: int = 0) -> None:
        """Return the request's blocks past its first `keep` to the free list (last block first)."""
        while len(request.blocks) > keep:
            self.pool.free(request.blocks.pop())

    def schedule(self) -> list[tuple[Request, list[int]]]:
        """The step's plan: (request, the tokens it feeds), drafts included."""
        plan = []
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted for an earlier request of this step
            draft = []
            if self.lookup and request.speculates and request.computed == len(request.tokens) - 1:
                room = request.params.max_new_tokens - len(request.generated) - 1  # never past max_new_tokens
                draft = propose(request.tokens, min(self.lookup, room)) if room > 0 else []
            feed = request.tokens[request.computed:] + draft
            while not self.reserve(request, len(feed)):
                if draft:  # drop the draft's last token before anyone loses their place
                    draft.pop()
                    feed.pop()
                    continue
                victim = self.running.pop()  # the most recently admitted: it loses the least work
                self.release(victim)
                victim.computed = 0  # recomputed from its tokens when admitted again; its random stream is untouched
                self.waiting.appendleft(victim)
                if victim is request:
                    break
            else:
                plan.append((request, feed))
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if blocks_for(len(request.tokens), self.pool.block_size) > self.pool.num_free:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.blocks, request.computed = self.pool.admit(request.tokens)
            self.reserve(request, len(request.tokens) - request.computed)
            self.running.append(request)
            plan.append((request, request.tokens[request.computed:]))
        return plan

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """Schedule, pack, run one forward, advance every request. Returns the requests that finished."""
        start, plan = time.perf_counter(), self.schedule()
        if not plan:
            return []
        bs, feeds, rows, positions, slots, n = self.pool.block_size, [], [], [], [], 0
        for r, feed in plan:
            keys, table = r.computed + len(feed), torch.tensor(r.blocks)
            where = torch.arange(r.computed, keys)  # the positions it feeds [T]
            positions.append(where)
            slots.append(table[where // bs] * bs + where % bs)  # block, then offset in it
            visible = torch.arange(keys)[None] <= where[:, None]  # [T, keys]: causal
            feeds.append(Feed(n, n + len(feed), table[:blocks_for(keys, bs)], keys, visible))
            rows.append(torch.arange(n + len(r.tokens) - r.computed - 1, n + len(feed)))  # last real token, draft
            n += len(feed)
        tokens = torch.tensor([t for _, feed in plan for t in feed])
        logits = self.model.forward(tokens, torch.cat(positions), torch.cat(slots), feeds, self.kv,
                                    torch.cat(rows))  # [R, V]
        record = {"fed": [], "tables": {r.id: list(r.blocks) for r, _ in plan}}
        finished, first = [], 0
        for (r, feed), wanted in zip(plan, rows):
            kind = "verify" if len(wanted) > 1 else "prefill" if len(feed) > 1 else "decode"
            gained = self.advance(r, feed, logits[first:first + len(wanted)])
            record["fed"].append((r.id, len(feed), kind, gained))
            first += len(wanted)
            if r.finish_reason is not None:
                self.release(r)
                self.running.remove(r)
                finished.append(r)
        record.update(free=self.pool.num_free, seconds=time.perf_counter() - start)
        self.history.append(record)
        return finished

    def advance(self, r: Request, feed: list[int], logits: torch.Tensor) -> int:
        """Choose the request's next token(s) from logits [1 + len(draft), V]; keep the agreeing draft
        prefix, roll the rest back. Returns how many tokens it gained."""
        draft = feed[len(r.tokens) - r.computed:]
        chosen = []
        for i in range(len(draft) + 1):
            row = logits[i]
            for processor in r.processors:
                row = processor(row, r.tokens)
            chosen.append(sample(row, r.params, r.generator))
            if i == len(draft) or chosen[-1] != draft[i]:
                break
        r.computed = len(r.tokens) + len(chosen) - 1  # keys of its tokens and the accepted draft are valid
        self.release(r, keep=blocks_for(r.computed, self.pool.block_size))  # blocks of the rejected tail only
        r.drafted, r.accepted = r.drafted + len(draft), r.accepted + len(chosen) - 1
        for token in chosen:
            self.append(r, token)
            if r.finish_reason is not None:
                break
        if r.finish_reason is not None and r.text is None and self.tokenizer is not None:
            r.text = self.tokenizer.decode(r.generated[:-1] if r.finish_reason == "eos" else r.generated)
        return len(chosen)

    def append(self, r: Request, token: int) -> None:
        r.tokens.append(token)
        if token == self.eos_token_id:
            r.finish_reason = "eos"
        elif r.stop is not None and (text := r.stop(self.tokenizer.decode(r.generated))) is not None:
            r.finish_reason, r.text = "stop", text
        elif len(r.generated) == r.params.max_new_tokens:
            r.finish_reason = "length"

    def run(self, prompts: list[list[int]], params: Params | list[Params] = Params(), arrivals: list[int] | None = None,
            **options) -> list[Request]:
        """Add prompt i at step arrivals[i] (default: all at step 0) and step until every request is
        done. Returns the requests in the prompts' order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        arrivals = arrivals or [0] * len(prompts)
        order, requests = sorted(range(len(prompts)), key=lambda i: arrivals[i]), [None] * len(prompts)
        step = 0
        while order or self.waiting or self.running:
            while order and arrivals[order[0]] <= step:
                i = order.pop(0)
                requests[i] = self.add_request(prompts[i], params[i], **options)
            self.step()
            step += 1
        return requests
