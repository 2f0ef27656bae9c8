"""A mixture-of-experts MLP (Qwen3-MoE, gpt-oss; lesson 17): a router sends each token to its top-k of E gated MLPs.

    probabilities = softmax(router(x))                  [tokens, E]   (in float32)
    weights, experts = top-k of them                    [tokens, k]   (rescaled to sum 1 if the model says so)
    y = Σ over the k picked experts e of  weight_e · down_e(silu(gate_e(x)) * up_e(x))

gpt-oss routes the other way round, top-k of the router's logits first and a softmax over
those k alone (`expert_router="topk_softmax"`), puts a bias on the router and on every
expert's projections, and clamps its SwiGLU (`swiglu_limit`): the gate at most `limit`,
the up projection within ±limit, then (up + 1) · gate · sigmoid(alpha · gate).

DeepSeek-V3 scores each expert with a sigmoid (`expert_router="sigmoid_groups"`), picks with
those scores plus a learned per-expert bias that only steers the choice (its load balancing
without an auxiliary loss), and only among the best few groups of experts (a group's score is
the sum of its two best); the picked scores, rescaled to sum 1 and times `routed_scale`, are
the weights. Beside its picks every token also runs the shared experts, one dense gated MLP
(`shared_ff` wide).

A model with 128 experts of which 8 run per token holds 16 times the MLP weights it reads for one
token: the parameters grow, the work per token does not. The experts' weights are stored as the
checkpoints of transformers 5 store them, one tensor for all experts (`gate_up` [E, 2·ff, d],
`down` [E, d, ff]), and each step runs only the experts some token picked: a loop over them
(which a decode token's k experts make short), gathering the tokens each one serves. That
loop's length depends on the data, so a compiled graph cannot hold it (such a model runs eagerly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        E, d, ff = config.num_experts, config.d_model, config.moe_ff or config.ff_size
        self.top_k, self.normalize = config.experts_per_token, config.norm_topk_prob
        self.kind = config.expert_router
        self.groups, self.groups_kept = config.expert_groups
        self.routed_scale = config.routed_scale
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.router = nn.Linear(d, E, bias=config.expert_bias)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * ff, d))
        self.down = nn.Parameter(torch.empty(E, d, ff))
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * ff)) if config.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(E, d)) if config.expert_bias else None
        if self.kind == "sigmoid_groups":
            self.register_buffer("score_bias", torch.zeros(E))  # steers the choice only, never the weights
        self.packed = None  # the experts stored another way (`minillm.speed.mx_experts`): it gives expert e's matrices
        self.shared_fc = nn.Linear(d, 2 * config.shared_ff, bias=False) if config.shared_ff else None
        self.shared_proj = nn.Linear(config.shared_ff, d, bias=False) if config.shared_ff else None
        self.load: torch.Tensor | None = None  # tokens each expert served, summed over the forwards since reset

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, d] -> (weights [N, k] in h's dtype, experts long [N, k]): each token's picks and their weights."""
        if self.kind == "sigmoid_groups":
            return self.route_in_groups(h)
        logits = self.router(h)
        if self.kind == "topk_softmax":  # gpt-oss: the k largest logits, then a softmax over those k
            top, experts = logits.topk(self.top_k, dim=-1)
            return top.softmax(-1), experts
        weights, experts = logits.softmax(-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(h.dtype), experts

    def route_in_groups(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's routing (see the module docstring), in float32 as transformers computes it."""
        scores = F.linear(h.float(), self.router.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.score_bias
        N, E = choice.shape
        group_scores = choice.view(N, self.groups, E // self.groups).topk(2, dim=-1).values.sum(-1)  # [N, groups]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
            1, group_scores.topk(self.groups_kept, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // self.groups, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scale).to(h.dtype), experts

    def matrices(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's gate/up [2ff, d] and down [d, ff] matrices, wherever they are kept."""
        return self.packed(e) if self.packed is not None else (self.gate_up[e], self.down[e])

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's gated MLP on the tokens h [n, d] it serves -> [n, d]."""
        biased = self.gate_up_bias is not None
        gate_up, down = self.matrices(e)
        gate, up = F.linear(h, gate_up, self.gate_up_bias[e] if biased else None).chunk(2, dim=-1)
        if self.limit is None:
            hidden = F.silu(gate) * up
        else:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            hidden = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return F.linear(hidden, down, self.down_bias[e] if biased else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # [N, d]: every token of every row
        weights, experts = self.route(h)
        if self.load is not None:
            self.load += torch.bincount(experts.flatten(), minlength=self.load.numel())
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():  # the experts some token picked, each over the tokens it serves
            token, slot = (experts == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self.expert(e, h[token]) * weights[token, slot, None])
        if self.shared_fc is not None:
            gate, up = self.shared_fc(h).chunk(2, dim=-1)
            out = out + self.shared_proj(F.silu(gate) * up)
        return out.view_as(x)

    def count_load(self) -> None:
        """Start counting how many tokens each expert serves (`self.load`, long [E]): the load a picture draws."""
        self.load = torch.zeros(self.router.out_features, dtype=torch.long, device=self.router.weight.device)


__all__ = ["MoE"]
