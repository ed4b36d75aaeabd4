"""The frozen companion models an objective runs beside the policy (a distillation teacher, a learned reward
model: `finetune.core.objectives.Companion`), as the planner counts them: each is one named term of the plan
(`companion:ROLE`), the bytes it holds on each rank plus its forward's transient peak, and its forward's FLOPs.

- Weights: every parameter in the compute dtype (the training stage loads it frozen in the run's dtype;
  DeepSpeed's bf16 stores it so too), divided over the ranks where the engine shards the policy (TRL prepares
  the teacher with the policy's engine: `prepare_deepspeed` under ZeRO-3, `accelerator.prepare_model` under
  FSDP2), and in host memory when the policy's parameters are offloaded.
- Forward working memory: it runs under no_grad, so nothing is saved for a backward: one decoder layer's
  forward tensors for the micro-batch's tokens, the hidden states in and out, one gathered layer under
  sharding, and its head's output: logits over the vocabulary for every token (`head="lm"`: the loss compares
  them whole with the policy's), or one value per sequence (`head="score"`).
- Time: 2 FLOPs a weight a token plus attention, every step (a forward only).

Pure: no torch, no I/O. The companions arrive resolved to their shapes (finetune/modeling/companions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.config import ModelConfig
from finetune.planner.activations import LayerRun, LayerShape, layer_bytes_per_token
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


def weight_bytes(c: CompanionShape, compute: int, shards: int, offload: bool) -> tuple[float, float]:
    """(on each rank, in host memory per rank) bytes of the companion's weights."""
    held = compute * c.counts.total / shards
    return (0.0, held) if offload else (held, 0.0)


def forward_peak(c: CompanionShape, compute: int, device: str, rows: int, tokens: int, sharded: bool) -> float:
    """The transient peak of its forward for a micro-batch of `rows` sequences, `tokens` in all (see the module
    docstring): a decoder layer's forward tensors, the hidden states in and out, a gathered layer, the head."""
    m = c.model
    run = LayerRun(method="full", dtype_bytes=compute, device=device)
    one_layer = layer_bytes_per_token(LayerShape.of(m), run) * tokens
    hidden = 2 * compute * tokens * m.hidden_size
    gathered = compute * c.counts.per_layer if sharded else 0
    head = compute * tokens * m.vocab_size if c.head == "lm" else 4 * rows
    return float(one_layer + hidden + gathered + head)


def flops_per_token(c: CompanionShape, seq_len: int) -> float:
    """Its forward's FLOPs a token: 2 a weight a token (the routed experts' share), plus causal attention."""
    m, counts = c.model, c.counts
    return 2.0 * (counts.linear - counts.unrouted + counts.head) + 2.0 * m.num_layers * seq_len * m.num_heads * m.head_dim


def terms(
    companions: tuple[CompanionShape, ...], s: Strategy, compute: int, device: str, rows: int, tokens: int,
    shards: int,
) -> tuple[tuple[str, float], ...]:  # fmt: skip
    """Each companion's term on a rank: (name, bytes) of its weights and its forward's peak."""
    sharded = s.engine.shards
    out = []
    for c in companions:
        held, _ = weight_bytes(c, compute, shards if sharded else 1, s.offload_params and sharded)
        out.append((c.term, held + forward_peak(c, compute, device, rows, tokens, sharded)))
    return tuple(out)


def host_bytes(companions: tuple[CompanionShape, ...], s: Strategy, compute: int, shards: int) -> float:
    """Companion weights offloaded with the policy's parameters, per rank."""
    if not (s.offload_params and s.engine.shards):
        return 0.0
    return sum(weight_bytes(c, compute, shards, True)[1] for c in companions)
