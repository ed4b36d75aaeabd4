"""Exact parameter counts from the architecture (not from a rounded model name)."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.config import MethodConfig, ModelConfig

# (d_in, d_out) of each projection a LoRA adapter can target, per decoder layer.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding (V x h)
    lm_head: int  # 0 when tied to the embedding
    linear_per_layer: int  # the seven projections of one decoder layer (weights only)
    other_per_layer: int  # norms and biases of one decoder layer
    final_norm: int
    num_layers: int

    @property
    def per_layer(self) -> int:
        return self.linear_per_layer + self.other_per_layer

    @property
    def linear(self) -> int:
        """Weights of every projection: what QLoRA quantizes to 4 bits."""
        return self.linear_per_layer * self.num_layers

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.per_layer * self.num_layers + self.final_norm

    @property
    def kept_16bit(self) -> int:
        """What QLoRA keeps in 16 bits: embeddings, the output layer, norms and biases."""
        return self.total - self.linear


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    h, i = m.hidden_size, m.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def count_params(m: ModelConfig) -> ParamCounts:
    shapes = projection_shapes(m)
    linear = sum(d_in * d_out for d_in, d_out in shapes.values())
    bias = (shapes["q_proj"][1] + shapes["k_proj"][1] + shapes["v_proj"][1]) if m.attention_bias else 0
    embedding = m.vocab_size * m.hidden_size
    return ParamCounts(
        embedding=embedding,
        lm_head=0 if m.tie_embeddings else embedding,
        linear_per_layer=linear,
        other_per_layer=2 * m.hidden_size + bias,
        final_norm=m.hidden_size,
        num_layers=m.num_layers,
    )


def lora_params(m: ModelConfig, method: MethodConfig) -> int:
    """r x (d_in + d_out) per targeted projection, over all decoder layers."""
    shapes = projection_shapes(m)
    unknown = sorted(set(method.target_modules) - set(_PROJECTIONS))
    if unknown:
        from finetune.errors import ConfigError

        raise ConfigError(f"method.target_modules has {', '.join(unknown)}; valid: {', '.join(_PROJECTIONS)}")
    per_layer = sum(method.lora_rank * sum(shapes[name]) for name in method.target_modules)
    return per_layer * m.num_layers
