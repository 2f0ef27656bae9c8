"""`ModelConfig`: every architecture of the course as switches of one frozen dataclass, not subclasses.

GPT-2's defaults, and the fields that turn the one transformer (`minillm.model.transformer`)
into Llama, Qwen, Gemma, Mistral, Phi-3, OPT, GPT-J, Qwen3-MoE or gpt-oss (lesson 17; `minillm.model.families`
reads them off a checkpoint's config).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

NORMS = ("layernorm", "rmsnorm", "gemma_rmsnorm")
MLPS = ("gelu", "relu", "swiglu", "geglu")
BLOCKS = ("pre", "post", "parallel")
LAYER_TYPES = ("full", "sliding")
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_groups")


@dataclass(frozen=True)
class ModelConfig:
    """Everything that shapes the network. Defaults are GPT-2 small; every other switch is off by default."""

    vocab_size: int = 50257
    context_length: int = 1024  # the most positions the model was trained on (nanoGPT calls it block_size)
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # grouped-query attention; None means n_head (plain multi-head)
    d_model: int = 768
    d_ff: int | None = None  # MLP hidden size; None means 4 * d_model
    head_dim: int | None = None  # None means d_model // n_head
    norm: str = "layernorm"  # "layernorm" (GPT-2), "rmsnorm" (Llama) or "gemma_rmsnorm" (x̂·(1 + w), Gemma)
    norm_eps: float = 1e-5
    positions: str = "learned"  # "learned" (GPT-2) or "rope" (Llama)
    rope_theta: float = 10000.0
    mlp: str = "gelu"  # "gelu" (GPT-2, tanh approximation), "relu" (OPT), "swiglu" (Llama) or "geglu" (Gemma)
    bias: bool = True  # bias on the output/MLP projections and norms (GPT-2)
    qkv_bias: bool = True  # bias on the q/k/v projection (GPT-2, Qwen2)
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    # --- model families (lesson 17) ---
    # "pre": x + f(norm(x)); "post": norm(x + f(x)) (OPT-350m); "parallel": attention and MLP side by side (GPT-J)
    block: str = "pre"
    post_norms: bool = False  # a norm on the attention and MLP outputs too: four norms per block (Gemma 2/3)
    qk_norm: bool = False  # normalise each query and key head before RoPE (Gemma 3, Qwen3)
    embed_scale: bool = False  # multiply the embedding by sqrt(d_model), rounded to the weights' dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim) (Gemma)
    sliding_window: int | None = None  # a sliding layer's query at position p sees keys at p - window < position <= p
    layer_types: tuple[str, ...] | None = None  # "full" / "sliding" per layer; None: all sliding when sliding_window is set
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None: rope_theta
    rotary_dim: int | None = None  # partial RoPE: only this many dims of each head rotate (GPT-J, some Phi)
    rope_short_factor: tuple[float, ...] | None = None  # long-RoPE (Phi-3): per-frequency divisors up to rope_original_max
    rope_long_factor: tuple[float, ...] | None = None  # ... and beyond it
    rope_original_max: int | None = None  # the context the model was pretrained on (long-RoPE switches past it)
    rope_attention_factor: float = 1.0  # long-RoPE and YaRN scale cos and sin by this
    rope_yarn_factor: float | None = None  # YaRN (gpt-oss): slow frequencies divided by this, fast ones kept
    rope_yarn_betas: tuple[float, float] = (32.0, 1.0)  # YaRN's ramp: rotations over rope_original_max (fast, slow)
    rope_yarn_truncate: bool = True  # round YaRN's ramp ends to whole dims (gpt-oss: False)
    attn_out_bias: bool | None = None  # bias on the attention output projection; None: `bias` (GPT-J has none, its MLP has)
    lm_head_bias: bool = False  # GPT-J
    d_embed: int | None = None  # token embedding width when it differs from d_model: project in and out (OPT-350m)
    final_norm: bool = True  # a norm before the LM head (OPT's post-norm models have none)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    # --- mixtures of experts (lesson 17: Qwen3-MoE) ---
    num_experts: int = 0  # experts per MoE layer; 0: every MLP is dense
    experts_per_token: int = 0  # top-k: the experts each token's router picks
    moe_ff: int | None = None  # each expert's hidden size (None: d_ff)
    norm_topk_prob: bool = False  # rescale the k picked probabilities to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP although the model has experts
    expert_router: str = "softmax_topk"  # "softmax_topk" (Qwen3-MoE), "topk_softmax" (gpt-oss), "sigmoid_groups"
    expert_groups: tuple[int, int] = (1, 1)  # sigmoid_groups (DeepSeek-V3): experts in this many groups, this many kept
    routed_scale: float = 1.0  # the picked experts' weights times this (DeepSeek-V3's routed_scaling_factor)
    shared_ff: int = 0  # hidden size of the experts every token runs besides its picks (DeepSeek-V3); 0: none
    expert_bias: bool = False  # a bias on the router and on each expert's projections (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha * g), g clamped
    swiglu_alpha: float = 1.702  # ... and its sigmoid's gain
    # --- attention sinks (gpt-oss) ---
    attn_sinks: bool = False  # one learned logit per head joins each softmax: attention may go nowhere
    # --- multi-head latent attention (DeepSeek-V3): keys and values from one small cached latent per token ---
    kv_lora_rank: int = 0  # the latent's width; 0: ordinary attention. head_dim is then the RoPE part's width
    q_lora_rank: int | None = None  # queries through a latent of this width too (None: one projection)
    qk_nope_dim: int = 0  # each head's query/key dims without position (from the latent)
    v_head_dim: int = 0  # each head's value width
    rope_interleaved: bool = False  # the checkpoint's RoPE turns neighbouring dims: the loader reorders their rows

    def __post_init__(self):
        for name, allowed in (("norm", NORMS), ("mlp", MLPS), ("block", BLOCKS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: use one of {', '.join(allowed)}")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"positions={self.positions!r}: use 'learned' or 'rope'")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.kv_heads}")
        if self.layer_types is not None and (len(self.layer_types) < self.n_layer
                                             or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types={self.layer_types!r}: give 'full' or 'sliding' for each of the "
                             f"{self.n_layer} layers")
        if self.expert_router not in ROUTERS:
            raise ValueError(f"expert_router={self.expert_router!r}: use one of {', '.join(ROUTERS)}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token}: pick 1 to num_experts={self.num_experts}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_size
                                            or (self.head_size - self.rotary_dim) % 2):
            raise ValueError(f"rotary_dim={self.rotary_dim}: use an even number up to head_dim={self.head_size} "
                             f"(leaving an even number of dims unrotated)")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    @property
    def ff_size(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def embed_size(self) -> int:
        return self.d_embed or self.d_model

    @property
    def cache_widths(self) -> tuple[int, int, int]:
        """(heads, key width, value width) of one token's cache entry in one layer. Latent attention caches one
        entry per token, the latent and the RoPE key side by side, and reads its values off the latent: no values."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.head_size, 0
        return self.kv_heads, self.head_size, self.head_size

    @property
    def cache_values_per_token(self) -> int:
        """Numbers the KV cache holds for each token, over all layers."""
        heads, key, value = self.cache_widths
        return self.n_layer * heads * (key + value)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through a sliding window."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding"

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def to_dict(self) -> dict:
        return asdict(self)


def describe(config: ModelConfig) -> str:
    """One line naming the architecture and its size."""
    n_params = (
        config.vocab_size * config.d_model
        + config.n_layer
        * (
            config.d_model * (config.n_head + 2 * config.kv_heads) * config.head_size
            + config.n_head * config.head_size * config.d_model
            + config.d_model * config.ff_size * (3 if config.mlp in ("swiglu", "geglu") else 2)
        )
    )
    return (
        f"{config.n_layer} layers, d_model {config.d_model}, {config.n_head} heads "
        f"({config.kv_heads} KV), {config.positions} positions, {config.norm}, {config.mlp}, "
        f"~{n_params / 1e6:.0f}M parameters, context {config.context_length}"
    )


__all__ = ["ModelConfig", "describe", "NORMS", "MLPS", "BLOCKS", "LAYER_TYPES", "ROUTERS"]
