"""Schema of distillation's settings (`objective=distill`): the teacher, and TRL's GKDConfig fields of the same
names (`temperature`, `beta`).

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
    # Softens both distributions before they are compared (logits / temperature); 1 compares them as they are.
    temperature: float = 1.0
    # The divergence (TRL's generalized Jensen-Shannon beta): 0 forward KL(teacher || student), 1 reverse
    # KL(student || teacher), between them the JSD with that mixture weight (0.5: the symmetric JSD).
    beta: float = 0.5

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
