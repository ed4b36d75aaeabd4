"""A reward model as the project loads and runs it: the two sequences of a preference pair, their scores, and a
trained reward model named by a path (GRPO's `objective.reward_model`: a reward-model run directory or its
exported folder), loaded beside the policy to score completions.

A reward model is a sequence classifier with one label (`ObjectiveSpec.head="score"`): one value a sequence,
read at its last token before the padding. It must share the policy's tokenizer: its scores are of the
policy's completions rendered with the policy's chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config, ModelConfig
from finetune.core.config.grpo import REWARD_MODEL_KEY as KEY
from finetune.core.config.grpo import check_reward_model
from finetune.core.errors import ConfigError
from finetune.modeling.loading import load_pretrained
from finetune.modeling.models import load_tokenizer
from finetune.modeling.variants import load_variant

# Pairs per forward when scoring: both sequences of each go through the model together (twice the rows).
BATCH_PAIRS = 8
# The name a learned reward is logged under beside the configured rewards.
LOGGED_NAME = "reward_model"


def pair_sequences(rows: Sequence[dict]) -> list[dict]:
    """The data stage's pairs (`prompt_ids`, `chosen_ids`, `rejected_ids`: each answer apart from its prompt) as
    the whole sequences a reward model scores: prompt + chosen and prompt + rejected (TRL's `chosen_ids` /
    `rejected_ids` of a reward data set)."""
    return [
        {
            "chosen_ids": list(r["prompt_ids"]) + list(r["chosen_ids"]),
            "rejected_ids": list(r["prompt_ids"]) + list(r["rejected_ids"]),
        }
        for r in rows
    ]


def pair_scores(
    model: Any, dataset: Any, pad_token_id: int, batch_pairs: int = BATCH_PAIRS
) -> list[list[float]]:
    """[chosen, rejected] scores of each held-out pair, batched as training batched them (TRL's collator)."""
    import torch
    from trl.trainer.reward_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    try:
        with torch.no_grad():
            for start in range(0, len(dataset), batch_pairs):
                rows = [dataset[i] for i in range(start, min(start + batch_pairs, len(dataset)))]
                batch = collate(pair_sequences(rows))
                logits = model(
                    input_ids=batch["input_ids"].to(device),
                    attention_mask=batch["attention_mask"].to(device),
                    use_cache=False,
                ).logits
                values = logits[:, 0].float().tolist()
                n = len(rows)
                out.extend([values[i], values[n + i]] for i in range(n))
    finally:
        model.train(was_training)
    return out


def text_scores(
    model: Any, tokenizer: Any, texts: Sequence[str], batch_size: int = 2 * BATCH_PAIRS
) -> list[float]:
    """The score of each rendered text (a prompt and its answer in the chat template), as TRL's GRPOTrainer scores
    a reward model's completions: right-padded, no special tokens added (the template has them)."""
    import torch

    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                list(texts[start : start + batch_size]),
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(device)
            out.extend(model(**batch).logits[:, 0].float().tolist())
    return out


@dataclass(frozen=True)
class Source:
    """Where a reward model named by a path loads from: a run directory (its config, and the variant: `merged`
    when exported, else `trained`) or a folder holding a saved sequence classifier."""

    path: Path
    run_config: Optional[Config] = None
    variant: Optional[str] = None


def find(path: str) -> Source:
    """What `objective.reward_model=PATH` names (`check_reward_model`: a reward-model run directory or a saved
    one-label sequence classifier), and for a run, which of its models: the export when there is one, else the
    trained output; a run that has not trained is one line naming the key."""
    folder = Path(path).expanduser()
    if check_reward_model(path) == "folder":
        return Source(folder)
    cfg = rundir.load_config(folder)
    if (rundir.merged_dir(folder) / "config.json").is_file():
        return Source(folder, cfg, "merged")
    if rundir.trained_dir(folder, cfg.method.uses_adapters).is_dir():
        return Source(folder, cfg, "trained")
    raise ConfigError(f"{KEY}={path}: the reward-model run has no trained output yet; run its training first")


def check_tokenizer(path: str, reward_tokenizer: Any, policy_tokenizer: Any) -> None:
    """The reward model reads the policy's tokens: the same vocabulary, or one line naming the key."""
    mine, theirs = policy_tokenizer.get_vocab(), reward_tokenizer.get_vocab()
    if mine != theirs:
        raise ConfigError(
            f"{KEY}={path}: its tokenizer is not the policy's ({len(theirs):,} tokens against {len(mine):,}); "
            "train the reward model from the policy's base model"
        )


def load(path: str, policy: ModelConfig, dtype: Any, devices: Optional[Any] = None) -> tuple[Any, Any]:
    """(the reward model ready for `eval()`, its tokenizer), after `find` and the tokenizer check."""
    source = find(path)
    if source.run_config is not None:
        cfg = source.run_config
        tokenizer = load_tokenizer(cfg.model)
        check_tokenizer(path, tokenizer, load_tokenizer(policy))
        assert source.variant is not None
        model = load_variant(cfg, source.path, source.variant)
        if hasattr(model, "merge_and_unload"):  # an adapter run: its score head and adapters folded in
            model = model.merge_and_unload()
        model = model.to(dtype)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source.path))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        check_tokenizer(path, tokenizer, load_tokenizer(policy))
        model = load_pretrained(policy, str(source.path), head="score", dtype=dtype, device_map=devices)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    # TRL logs a model reward under its config's name (rewards/reward_model/mean), not the folder's ("merged")
    model.config._name_or_path = LOGGED_NAME
    model.requires_grad_(False)
    return model.eval(), tokenizer
