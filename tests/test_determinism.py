"""Determinism on the CPU: the same seed, data and config give the same loss trajectory and weights, bit for bit.

(GPUs do not promise this: see the README, "when a run dies".)
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_eval_support import train_in_process


def _run(run: Path, tiny_data, *overrides: str) -> tuple[list[float], dict]:
    from safetensors.torch import load_file

    from finetune.pipeline.cli import compose

    cfg = compose(
        [
            f"run_dir={run}",
            "train.seq_len=128",
            "train.max_steps=6",
            "train.save_steps=6",
            "train.logging_steps=1",
            "train.eval_steps=1000",
            "train.report_to=[]",
            "method.lora_dropout=0.1",  # random masks every step: the seed must drive them
            *overrides,
        ]
    )
    train_in_process(
        cfg, tiny_data, n_train=48, n_eval=4, max_generate=1, micro_batch_size=2, grad_accum_steps=2
    )
    history = json.loads((run / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())[
        "log_history"
    ]
    return [e["loss"] for e in history if "loss" in e], load_file(
        str(run / "adapter" / "adapter_model.safetensors")
    )


def test_same_seed_same_trajectory_other_seed_differs(tmp_path, tiny_cache, tiny_data):
    import torch

    a_losses, a = _run(tmp_path / "a", tiny_data)
    b_losses, b = _run(tmp_path / "b", tiny_data)
    assert len(a_losses) == 6 and a_losses == b_losses  # exact, not approximately
    assert all(torch.equal(a[k], b[k]) for k in a)
    c_losses, _ = _run(tmp_path / "c", tiny_data, "train.seed=7")
    assert c_losses != a_losses  # the seed is what drives it (adapter init, dropout)
