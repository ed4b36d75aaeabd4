"""The frozen companion models an objective runs beside the policy (a distillation teacher, a learned reward
model: `finetune.core.objectives.Companion`), as the planner counts them: each is one named term of the plan
(`companion:ROLE`), the bytes it holds on each rank plus its forward's transient peak, and its forward's FLOPs.

- Weights: every parameter in the compute dtype (the training stage loads it frozen in the run's dtype;
  DeepSpeed's bf16 stores it so too), divided over the ranks where the engine shards the policy (TRL prepares
  the teacher with the policy's engine: `prepare_deepspeed` under ZeRO-3, `accelerator.prepare_model` under
  FSDP2), and in host memory when the policy's parameters are offloaded.
- Forward working memory: it runs under no_grad, so nothing is saved for a backward: the larger of one
  decoder layer's live tensors and its head's (the final hidden states and the head's output: logits over
  the vocabulary for every token with `head="lm"`, which the loss compares whole with the policy's; one value
  per sequence with `head="score"`), the packed rows' mask and, under sharding, one gathered layer
  (`forward_peak`).
- The comparison: where the loss compares the policy's whole logits with a language-model companion's
  (distillation's divergence, no tiling), the two logits and the loss's copies of them (`logit_copies`,
  measured per divergence by the objective), after the forward and so the larger of the two peaks.
- Time: 2 FLOPs a weight a token plus attention, every step (a forward only).

Pure: no torch, no I/O. The companions arrive resolved to their shapes (finetune/modeling/companions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.config import ModelConfig
from finetune.planner.contract import Strategy
from finetune.planner.params import ParamCounts, count_params

# What a companion's forward ends in (Companion.head).
HEADS = ("lm", "score")


@dataclass(frozen=True)
class CompanionShape:
    """A companion as the planner sees it: its role (the term's name), its model's shape and its head."""

    role: str
    model: ModelConfig
    head: str = "lm"
    # the loss's copies of the [tokens, vocabulary] logits while it compares the policy's with this one's
    logit_copies: float = 0.0

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"companion {self.role}: head={self.head!r} is not one of {HEADS}")

    @property
    def term(self) -> str:
        """Its name in plan.json and the plan table."""
        return f"companion:{self.role}"

    @property
    def counts(self) -> ParamCounts:
        return count_params(self.model)

    @property
    def head_params(self) -> int:
        """Its head's weights: the LM head ([V, h], none of its own when tied), or a score head's [1, h]."""
        return self.counts.lm_head if self.head == "lm" else self.model.hidden_size

    @property
    def params(self) -> int:
        """Every parameter it holds."""
        return self.counts.total - self.counts.lm_head + self.head_params


def weight_bytes(c: CompanionShape, compute: int, shards: int, offload: bool) -> tuple[float, float]:
    """(on each rank, in host memory per rank) bytes of the companion's weights."""
    held = compute * c.params / shards
    return (0.0, held) if offload else (held, 0.0)


def forward_peak(
    c: CompanionShape, compute: int, rows: int, seq_len: int, packed: bool, sharded: bool
) -> float:
    """The transient peak of its forward for a micro-batch of `rows` sequences of `seq_len` tokens (see the
    module docstring). Under no_grad a tensor is freed once the next one is made, so the peak is the larger of
    a decoder layer's and the head's live tensors: in a layer, the MLP's activated gate, up projection and
    their product (3 x intermediate a token) beside the residual stream, its normed copy, the attention
    output and the layer's output (4 x hidden) and the rotary cos and sin (2 x head_dim); at the head, the
    final hidden states and their norm (2 x hidden) and its output (the vocabulary's logits, or one value per
    sequence). Packed rows add the block-diagonal boolean mask its forward builds (one byte a token pair), a
    sharding engine one gathered layer. Measured exactly on the tiny model (tests/test_companions.py)."""
    m, tokens = c.model, rows * seq_len
    layer = compute * tokens * (3 * m.intermediate_size + 4 * m.hidden_size + 2 * m.head_dim)
    out = compute * tokens * m.vocab_size if c.head == "lm" else 4 * rows
    head = compute * tokens * 2 * m.hidden_size + out
    mask = rows * seq_len**2 if packed else 0
    gathered = compute * c.counts.per_layer if sharded else 0
    return float(max(layer, head) + mask + gathered)


def comparison_peak(c: CompanionShape, compute: int, tokens: int) -> float:
    """Where the loss compares the policy's whole logits with the companion's (`logit_copies` > 0): both logits
    and the loss's copies of them, [tokens, vocabulary] each in the compute dtype; 0 otherwise."""
    if not c.logit_copies:
        return 0.0
    return (2 + c.logit_copies) * compute * tokens * c.model.vocab_size


def flops_per_token(c: CompanionShape, seq_len: int) -> float:
    """Its forward's FLOPs a token: 2 a weight a token (the routed experts' share), plus causal attention."""
    m, counts = c.model, c.counts
    head = counts.head if c.head == "lm" else m.hidden_size
    return (
        2.0 * (counts.linear - counts.unrouted + head)
        + 2.0 * m.num_layers * seq_len * m.num_heads * m.head_dim
    )


def loss_peak(companions: tuple[CompanionShape, ...], loss_compute: int, tokens: int) -> float:
    """The loss's peak where it compares the policy's whole logits with a companion's (distillation): the largest
    comparison, in the loss's dtype (fp32 under autocast, whose log-softmax runs in fp32); 0 where none does."""
    return max((comparison_peak(c, loss_compute, tokens) for c in companions), default=0.0)


def terms(
    companions: tuple[CompanionShape, ...], s: Strategy, compute: int, rows: int, seq_len: int, packed: bool,
    shards: int, loss_compute: int = 0,
) -> tuple[tuple[str, float], ...]:  # fmt: skip
    """Each companion's term on a rank: (name, bytes) of its weights and its forward's peak. Where the loss
    compares whole logits with it, that comparison is the loss's term (`loss_peak`), which follows its forward:
    the term keeps only what its forward holds beyond the comparison."""
    sharded = s.engine.shards
    out = []
    for c in companions:
        held, _ = weight_bytes(c, compute, shards if sharded else 1, s.offload_params and sharded)
        forward = forward_peak(c, compute, rows, seq_len, packed, sharded)
        comparison = comparison_peak(c, loss_compute or compute, rows * seq_len)
        out.append((c.term, held + max(0.0, forward - comparison)))
    return tuple(out)


def host_bytes(companions: tuple[CompanionShape, ...], s: Strategy, compute: int, shards: int) -> float:
    """Companion weights offloaded with the policy's parameters, per rank."""
    if not (s.offload_params and s.engine.shards):
        return 0.0
    return sum(weight_bytes(c, compute, shards, True)[1] for c in companions)
