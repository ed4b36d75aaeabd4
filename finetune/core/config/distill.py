"""Schema of distillation's settings (`objective=distill`): the teacher, and TRL's GKDConfig fields of the same
names (`temperature`, `beta`, `lmbda`, `seq_kd`; `max_completion_length` is GKDConfig's `max_new_tokens`, named
as GRPO's settings name it).

Which sequences the teacher scores: the data's answers (off-policy, `lmbda=0`, the default), the student's own
samples in a share `lmbda` of the micro-batches (on-policy), or the teacher's samples (`seq_kd`: sequence-level
distillation, in the micro-batches the student does not sample). Sampled micro-batches generate inside the
training step with transformers' `generate`, as GRPO's `generation=transformers` does; the planner counts that
rollout (finetune/planner/rollout.py).

The teacher is named as `model=` names a model: a preset (`llama3_1_70b`), a local folder with a config.json, a
hub id (`ORG/NAME`), or a finished run directory (its fully trained model or merged export). It must share the
student's vocabulary: the loss compares their next-token distributions token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.config.checks import check_positive, choice
from finetune.core.config.objective import ObjectiveConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES, Companion


@dataclass
class DistillObjective(ObjectiveConfig):
    """Knowledge distillation: `objective=distill objective.teacher=runs/teacher objective.beta=0`."""

    name: str = choice("distill", OBJECTIVES)
    # The frozen teacher, named as `model=` names a model: a preset, a folder, a hub id or a run directory.
    teacher: str = ""
    # Softens both distributions before they are compared (logits / temperature), and the sampling temperature
    # where the step generates; 1 compares (and samples) them as they are.
    temperature: float = 1.0
    # The divergence (TRL's generalized Jensen-Shannon beta): 0 forward KL(teacher || student), 1 reverse
    # KL(student || teacher), between them the JSD with that mixture weight (0.5: the symmetric JSD).
    beta: float = 0.5
    # The share of micro-batches on the student's own samples of the prompts (on-policy; TRL's `lmbda`): 0 the
    # data's answers only, 1 every micro-batch sampled.
    lmbda: float = 0.0
    # The other micro-batches on the teacher's samples of the prompts instead of the data's answers
    # (sequence-level distillation; TRL's `seq_kd`).
    seq_kd: bool = False
    # Tokens sampled per completion at most where the step generates (TRL's GKDConfig `max_new_tokens`).
    max_completion_length: int = 64

    # Where completions are sampled: GKD generates inside the trainer with transformers (no vLLM path), one
    # completion a prompt.
    generation = "transformers"
    samples_with_vllm = False
    # Micro-batches trained on one generation round: GKD samples for each micro-batch it draws.
    steps_per_generation = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.teacher:
            raise ConfigError(
                "objective.teacher is not set: name the teacher as model= names a model "
                "(a preset, a folder, a hub id or a run directory)"
            )
        check_positive("objective.temperature", self.temperature)
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"objective.beta={self.beta}: must lie in [0, 1] (0 forward KL, 1 reverse KL)")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ConfigError(
                f"objective.lmbda={self.lmbda}: must lie in [0, 1] (the share of micro-batches the student samples)"
            )
        check_positive("objective.max_completion_length", self.max_completion_length)

    @property
    def generates(self) -> bool:
        """The step samples completions: the student's (`lmbda > 0`) or the teacher's (`seq_kd`)."""
        return self.lmbda > 0 or self.seq_kd

    def samplers(self) -> tuple[tuple[str, float], ...]:
        """The student in a share `lmbda` of the micro-batches, the teacher in the others under `seq_kd`."""
        shares = (("policy", self.lmbda), ("teacher", 1.0 - self.lmbda if self.seq_kd else 0.0))
        return tuple((who, share) for who, share in shares if share > 0)

    def rollout_rows(self, data_rows: int, generated_rows: int) -> int:
        """The widest row a step trains on: the generated rows where every micro-batch samples (`lmbda=1` or
        `seq_kd`), else the data's rows too (the micro-batches on the data's answers)."""
        return generated_rows if self.lmbda == 1 or self.seq_kd else max(data_rows, generated_rows)


# The [tokens, vocabulary] copies TRL's `generalized_jsd_loss` holds at its peak, forward and backward, beside the
# student's and the teacher's logits (each divided by the temperature, their log-softmax, the divergence and its
# gradients; the JSD adds the mixture's): measured with tests/test_distill.py's live-byte count.
FORWARD_KL_COPIES = 7.0
REVERSE_KL_COPIES = 8.0
JSD_COPIES = 15.0


def companions(settings: DistillObjective) -> tuple[Companion, ...]:
    """The teacher beside the student: forward-only, its logits over the shared vocabulary compared whole."""
    copies = {0.0: FORWARD_KL_COPIES, 1.0: REVERSE_KL_COPIES}.get(settings.beta, JSD_COPIES)
    return (Companion("teacher", settings.teacher, head="lm", logit_copies=copies),)
