"""A mixture-of-experts MLP (Qwen3-MoE, lesson 17): a router sends each token to its top-k of E gated MLPs.

    probabilities = softmax(router(x))                  [tokens, E]   (in float32)
    weights, experts = top-k of them                    [tokens, k]   (rescaled to sum 1 if the model says so)
    y = Σ over the k picked experts e of  weight_e · down_e(silu(gate_e(x)) * up_e(x))

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
        self.router = nn.Linear(d, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * ff, d))
        self.down = nn.Parameter(torch.empty(E, d, ff))
        self.load: torch.Tensor | None = None  # tokens each expert served, summed over the forwards since reset

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [N, d] -> (weights [N, k] in h's dtype, experts long [N, k]): each token's picks and their weights."""
        probabilities = self.router(h).softmax(-1, dtype=torch.float32)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(h.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # [N, d]: every token of every row
        weights, experts = self.route(h)
        if self.load is not None:
            self.load += torch.bincount(experts.flatten(), minlength=self.load.numel())
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():  # the experts some token picked, each over the tokens it serves
            token, slot = (experts == e).nonzero(as_tuple=True)
            gate, up = F.linear(h[token], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.view_as(x)

    def count_load(self) -> None:
        """Start counting how many tokens each expert serves (`self.load`, long [E]): the load a picture draws."""
        self.load = torch.zeros(self.gate_up.shape[0], dtype=torch.long, device=self.gate_up.device)


__all__ = ["MoE"]
