"""Two processes under torchrun (gloo) on the CPU: the engine the plan chose really runs, and trains like one process.

    pytest -m distributed tests/test_distributed.py      # about 5 minutes on 2 cores (+2 the first time:
                                                        # DeepSpeed compiles its CPU Adam and shm ops)

Each run is driven as a user drives it (`python -m finetune mode=data`, then
`mode=train`, which goes through the launcher: `torchrun --standalone
--nproc_per_node=2 -m finetune.train RUN_DIR`). The worker records what ran in
metrics.json `train.engine` (world size, backend, the wrapper around the model,
ZeRO stage, offload, each rank's pid and share of the parameters); the tests
assert on that, and compare the loss trajectory with one process taking the
same global batch (micro-batch x accumulation x world size = 16 sequences).

accelerate enables FSDP only on accelerators (on CPU ranks the Trainer's FSDP
silently becomes DDP); FinetuneTrainer installs its FSDP2 plugin on CPU ranks
too, so the Trainer's own FSDP2 path runs here, with gloo.

The ZeRO-3 and FSDP2 runs use the chunked loss (what the 70B and 32B recipes
plan), computed inside the model's forward where each engine has the head whole;
read after the forward, ZeRO-3's head is already partitioned again (weight of
shape (0,)).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SEQ_LEN, adapter_weights, losses, run_modes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
# Measured on 2 CPU cores, fp32, against one process with the same global batch (all with the chunked
# loss), largest relative loss difference / largest weight difference: DDP 0 / 0; ZeRO-3 1.1e-7 /
# 9.1e-6; ZeRO-3 with DeepSpeed's CPU Adam 1.8e-6 / 2.0e-5; FSDP2 0 / 7.9e-6. AdamW steps by
# lr * m / sqrt(v), so where a gradient is near zero a 1e-7 difference in reduction order can flip a
# good part of an lr-sized step. The loss trajectory is the tight check; the weights' bound (0.1% of
# the largest LoRA weight, about 0.09) still catches an adapter that did not train or was not gathered.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4  # max |difference| of any trained weight
RUN_TIMEOUT_S = 900


def overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "hardware=cpu",
        f"train.max_steps={STEPS}",
        SEQ_LEN,
        "train.batch_size=16",
        "train.logging_steps=1",
        "train.warmup_ratio=0.0",  # every step updates the weights
        # Dropout draws each rank's masks from its own generator: two processes could then match one
        # only in distribution (measured: 1e-3 apart in the first step's gradient norm).
        "method.lora_dropout=0.0",
        f"train.save_steps={STEPS}",  # one checkpoint at the end: its trainer_state.json holds the losses
        "train.eval_steps=1000",
        f"data.cache_dir={cache}",
        # The loss the 70B and 32B recipes plan, computed inside the model's forward (every run here,
        # the reference too: the two loss paths agree to ~1e-7, which AdamW turns into ~1e-5 in weights).
        "train.chunked_loss=true",
        *extra,
    ]


def pipeline_run(root: Path, name: str, *extra: str) -> dict:
    """mode=data then mode=train (the launcher spawns the ranks); returns metrics.json, losses and the log."""
    run_dir = root / name
    log = run_modes(overrides(run_dir, root / "data-cache", *extra), root / name, timeout=RUN_TIMEOUT_S)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    trained = losses(run_dir / "checkpoints" / f"checkpoint-{STEPS}")
    return {"dir": run_dir, "metrics": metrics, "losses": trained, "log": log}


def assert_same_trajectory(run: dict, reference: dict) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"]))
    assert worst <= LOSS_RTOL, f"losses {run['losses']} vs one process {reference['losses']}"
    mine, ref = adapter_weights(run["dir"]), adapter_weights(reference["dir"])
    assert mine.keys() == ref.keys() and mine
    for key in ref:
        diff = float((mine[key] - ref[key]).abs().max())
        assert diff <= WEIGHT_ATOL, f"{key}: saved adapter differs from one process by {diff}"


def assert_two_ranks(engine: dict) -> None:
    assert engine["world_size"] == 2 and engine["backend"] == "gloo"
    ranks = engine["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]


def assert_rank0_hygiene(run: dict) -> None:
    """One progress bar and one TensorBoard events file (rank 0's), no half-written files left behind."""
    assert run["log"].count("train ━") == 1, run["log"][-3000:]
    assert len(list((run["dir"] / "tensorboard").glob("events.out.tfevents.*"))) == 1
    leftovers = [p for p in run["dir"].rglob("*.tmp")] + list(run["dir"].glob("checkpoints/.staging/*"))
    assert leftovers == []


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("distributed")


@pytest.fixture(scope="module")
def reference(root) -> dict:
    """One process, micro-batch 8 x accumulation 2: the same 16 sequences a step as 2 ranks x 8 x 1."""
    run = pipeline_run(
        root,
        "one-process",
        "hardware.gpus_per_node=1",
        "train.micro_batch_size=8",
        "train.grad_accum_steps=2",
    )
    assert run["metrics"]["train"]["engine"]["world_size"] == 1
    assert run["metrics"]["train"]["engine"]["wrapper"] != "DistributedDataParallel"
    return run


def test_ddp_two_processes_train_like_one(root, reference):
    run = pipeline_run(root, "ddp", "hardware.gpus_per_node=2")
    plan = json.loads((run["dir"] / "plan.json").read_text())
    assert plan["strategy"]["sharding"] == "ddp"  # the planner's choice for 2 "GPUs" that each hold the job
    assert plan["strategy"]["micro_batch_size"] * plan["strategy"]["grad_accum_steps"] * 2 == 16
    engine = run["metrics"]["train"]["engine"]
    assert_two_ranks(engine)
    assert engine["wrapper"] == "DistributedDataParallel" and engine["zero_stage"] is None
    assert_same_trajectory(run, reference)
    assert_rank0_hygiene(run)
    assert "eval" not in run["metrics"]  # the ranks train; scoring is the eval stage's (mode=eval)
    assert "ACCELERATE_USE_CPU=true" in (run["dir"] / "launch.sh").read_text()


# One unexplained failure in about ten runs of the offload case (after its last checkpoint; the
# ranks' logs are kept for diagnosis): one rerun, so CI reports a repeat, not a fluke.
@pytest.mark.flaky(reruns=1)
# CI runs the ZeRO-3 case; optimizer offload runs in CI through llama70b_full's rehearsal
# (tests/test_recipe_rehearsal.py) and here with -m extended.
@pytest.mark.parametrize(
    "offload", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["zero3", "zero3-offload"]
)
def test_deepspeed_zero3_two_processes_train_like_one(root, reference, offload):
    extra = [
        "train.sharding=zero3",
        "train.engine=zero3",
        f"train.offload_optimizer={str(offload).lower()}",
    ]
    run = pipeline_run(root, "zero3-offload" if offload else "zero3", "hardware.gpus_per_node=2", *extra)
    assert (run["dir"] / "deepspeed.json").is_file()
    engine = run["metrics"]["train"]["engine"]
    assert_two_ranks(engine)
    assert engine["wrapper"] == "DeepSpeedEngine" and engine["zero_stage"] == 3
    assert engine["loaded_partitioned"]  # zero.Init: no rank ever held the whole model
    assert engine["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    if offload:
        assert engine["offload_optimizer"] == "cpu" and engine["base_optimizer"] == "DeepSpeedCPUAdam"
    else:
        assert engine["offload_optimizer"] is None and engine["base_optimizer"] == "AdamW"
    for r in engine["ranks"]:  # each rank holds half of the (partitioned) weights
        assert r["parameters_held"] < 0.6 * r["parameters"]
    # The adapter saved from the partitioned weights (stage3_gather_16bit_weights_on_model_save)
    # equals one process's: the gather worked and the trajectory matched.
    assert_same_trajectory(run, reference)
    assert_rank0_hygiene(run)
    assert "eval" not in run["metrics"]  # the ranks train; scoring is the eval stage's (mode=eval)
    assert "ACCELERATE_USE_CPU" not in (run["dir"] / "launch.sh").read_text()


def test_fsdp2_trainer_two_processes_train_like_one(root, reference):
    """The Trainer's FSDP2 path (accelerate's plugin, fully_shard per decoder layer), chunked loss."""
    extra = ["train.sharding=fsdp", "train.engine=fsdp"]
    run = pipeline_run(root, "fsdp2", "hardware.gpus_per_node=2", *extra)
    assert (run["dir"] / "accelerate_fsdp.yaml").is_file()
    engine = run["metrics"]["train"]["engine"]
    assert_two_ranks(engine)
    assert engine["wrapper"].startswith("FSDP") and engine["zero_stage"] is None
    assert engine["loss"] == "chunked" and engine["optimizer_kind"] == "adamw"
    assert not engine["loaded_partitioned"]
    for r in engine["ranks"]:  # each rank holds its DTensor shard: half of every parameter
        assert r["parameters_held"] < 0.6 * r["parameters"]
    # The adapter gathered from the shards equals one process's (Trainer.save_model wrote nothing here).
    assert_same_trajectory(run, reference)
    assert_rank0_hygiene(run)
    assert "eval" not in run["metrics"]
