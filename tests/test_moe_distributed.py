"""The tiny Qwen3-MoE with LoRA on attention and experts on two CPU ranks (torchrun, gloo): DDP, DeepSpeed ZeRO-3
and FSDP2 each run (the engine record: world size, wrapper class, each rank's share of the parameters) and the
held-out loss the trainer logs falls. DDP runs by default (about 40 s); ZeRO-3 and FSDP2 are `extended`.

    python -m pytest -m "distributed and not extended" tests/test_moe_distributed.py   # DDP
    python -m pytest -m extended tests/test_moe_distributed.py                          # ZeRO-3, FSDP2
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import EXPERT_LORA, SEQ_LEN, TINY_MOE, run_modes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 8
ENGINES = {
    "ddp": ("train.sharding=ddp",),
    "zero3": ("train.sharding=zero3", "train.engine=zero3"),
    "fsdp2": ("train.sharding=fsdp", "train.engine=fsdp"),
}
WRAPPERS = {"ddp": "DistributedDataParallel", "zero3": "DeepSpeedEngine", "fsdp2": "FSDP"}


def _run(tmp_path: Path, engine: str) -> tuple[dict, list[float]]:
    run_dir = tmp_path / engine
    args = [
        f"run_dir={run_dir}", "hardware=cpu", "hardware.gpus_per_node=2", *TINY_MOE, *EXPERT_LORA,
        "method.learning_rate=3e-3", f"train.max_steps={STEPS}", SEQ_LEN, "train.batch_size=4",
        "train.logging_steps=1", "train.warmup_ratio=0.0", f"train.save_steps={STEPS}", "train.eval_steps=2",
        "data.eval_fraction=0.02", f"data.cache_dir={tmp_path / 'data-cache'}", "train.report_to=[]",
        *ENGINES[engine],
    ]  # fmt: skip
    run_modes(args, tmp_path / engine, timeout=900)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    history = json.loads((run_dir / "checkpoints" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    held_out = [e["eval_loss"] for e in history["log_history"] if "eval_loss" in e]
    return metrics, held_out


def _check(tmp_path: Path, engine: str) -> None:
    metrics, held_out = _run(tmp_path, engine)
    record = metrics["train"]["engine"]
    assert record["world_size"] == 2 and record["backend"] == "gloo"
    assert record["wrapper"].startswith(WRAPPERS[engine]), record["wrapper"]
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    if engine != "ddp":  # each rank holds its shard of every parameter, the experts' included
        assert all(r["parameters_held"] < 0.6 * r["parameters"] for r in record["ranks"])
    assert len(held_out) == STEPS // 2 and all(math.isfinite(x) for x in held_out)
    assert held_out[-1] < held_out[0] - 0.05, held_out
    assert metrics["train"]["router_aux_loss_coef"] == 0.001 and metrics["train"]["final_aux_loss"] > 1.0


def test_ddp_two_ranks_train_the_tiny_moe(tmp_path, tiny_cache):
    _check(tmp_path, "ddp")


@pytest.mark.extended
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_engines_train_the_tiny_moe(tmp_path, tiny_cache, engine):
    _check(tmp_path, engine)
