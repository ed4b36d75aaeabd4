"""Schema of the `chat` section: `python -m finetune mode=chat` (finetune/evaluation/chat.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from finetune.core.config.checks import check_choices, choice

# The models of a run, as the evaluation names them.
CHAT_MODELS = ("base", "trained", "merged")


@dataclass
class ChatConfig:
    """Which of the run's models to talk to, and an optional system prompt; generation follows eval.*
    (greedy, temperature, top_p, seed, max_new_tokens), as the evaluation generates."""

    # base (the model training started from), trained (the adapter on the base, or the fully fine-tuned
    # model) or merged (export's merged model).
    model: str = choice("trained", CHAT_MODELS)
    system_prompt: Optional[str] = None

    def __post_init__(self) -> None:
        check_choices(self, "chat")
