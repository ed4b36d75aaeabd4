"""Determinism on the CPU: the same seed, data and config give the same loss trajectory and weights, bit for bit.

(GPUs do not promise this: see the README, "when a run dies".)
"""

from __future__ import annotations

from pathlib import Path

from helpers import adapter_weights, losses, tiny_cfg, train_run


def _train(run: Path, tiny_data, *overrides: str) -> tuple[list[float], dict]:
    """Six steps of 2 x 2 rows on 48 rows; the per-step losses and the trained adapter."""
    cfg = tiny_cfg(
        "train.max_steps=6",
        "train.save_steps=6",
        "method.lora_dropout=0.1",  # random masks every step: the seed must drive them
        *overrides,
        run_dir=run,
    )
    train_run(cfg, tiny_data, n_train=48, n_eval=4, max_generate=1, micro_batch_size=2, grad_accum_steps=2)
    return losses(run / "checkpoints" / "checkpoint-6"), adapter_weights(run)


def test_same_seed_same_trajectory_other_seed_differs(tmp_path, tiny_cache, tiny_data):
    import torch

    a_losses, a = _train(tmp_path / "a", tiny_data)
    b_losses, b = _train(tmp_path / "b", tiny_data)
    assert len(a_losses) == 6 and a_losses == b_losses  # exact, not approximately
    assert all(torch.equal(a[k], b[k]) for k in a)
    c_losses, _ = _train(tmp_path / "c", tiny_data, "train.seed=7")
    assert c_losses != a_losses  # the seed is what drives it (adapter init, dropout)
