"""The last step is the last step under every engine: a run stopped once the checkpoint of its final step was
saved, before its output was (what SIGTERM during the last step leaves), run again trains no step more and
saves the uninterrupted run's adapter bit for bit.

    pytest -m distributed tests/test_reliability_r3_last_step.py     # CI: SFT under ZeRO-3 on two CPU ranks
    pytest -m extended tests/test_reliability_r3_last_step.py        # DDP, FSDP2, and DPO under each

One process loads the final checkpoint's weights without training (`callbacks.finish_from_final_checkpoint`);
DeepSpeed and FSDP load a checkpoint only inside the training loop, once the model is wrapped, and there the
loop fetches no batch past the schedule (`callbacks.past_the_schedule`). The in-process test drives that loop
path on one process too, with the first path switched off.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import SEQ_LEN, run_modes, tiny_cfg

STEPS = 4
RUN_TIMEOUT_S = 900


def _leave_as_a_stop_after_the_final_checkpoint(run: Path, output: str = "adapter") -> bytes:
    """The adapter the uninterrupted run saved; then what a stop after checkpoint-STEPS leaves: no output, no
    metrics."""
    weights = (run / output / "adapter_model.safetensors").read_bytes()
    shutil.rmtree(run / output)
    (run / "metrics.json").unlink()
    return weights


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("checkpoint-"))


@pytest.mark.slow  # two short runs a case, in this process
@pytest.mark.parametrize("objective", ["sft", pytest.param("dpo", marks=pytest.mark.extended)])
def test_the_training_loop_takes_no_step_past_the_schedule(tmp_path, tiny_cache, monkeypatch, objective):
    """The loop's own guard, as DeepSpeed and FSDP runs meet it: resumed from checkpoint-4 of a 4-step run, the
    trainer loads it, fetches no batch and saves the same adapter."""
    from helpers import prepare_run

    from finetune.pipeline.stages import plan_stage, resolve
    from finetune.train import callbacks, stage

    extra = ("objective=dpo",) if objective == "dpo" else ()
    cfg = resolve(
        tiny_cfg(
            f"train.max_steps={STEPS}", "train.save_steps=2", "train.save_total_limit=4", "train.batch_size=2",
            "data.eval_fraction=0.05", f"data.cache_dir={tmp_path / 'cache'}", *extra, run_dir=tmp_path / "run",
        )
    )  # fmt: skip
    run = prepare_run(cfg)
    plan = plan_stage(cfg, run, quiet=True)
    assert stage.run(cfg, run, plan)["train"]["steps"] == STEPS
    weights = _leave_as_a_stop_after_the_final_checkpoint(run)
    fetched: list[int] = []
    guard = callbacks.past_the_schedule

    def counted(trainer):
        past = guard(trainer)
        fetched.append(int(past))
        return past

    monkeypatch.setattr(callbacks, "finish_from_final_checkpoint", lambda trainer, checkpoint: False)
    monkeypatch.setattr("finetune.train.base_trainer.past_the_schedule", counted)
    again = stage.run(cfg, run, plan)
    assert fetched == [1]  # asked once, before the first batch: past the schedule, nothing fetched
    assert again["train"]["steps"] == STEPS and again["train"]["step_seconds"] == []
    assert again["train"]["resumed_from"] == str((run / "checkpoints" / f"checkpoint-{STEPS}").resolve())
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == weights
    assert _checkpoints(run) == ["checkpoint-2", "checkpoint-4"]


def _args(root: Path, name: str, objective: str, engine: str) -> list[str]:
    engines = {
        "ddp": (),
        "zero3": ("train.sharding=zero3", "train.engine=zero3"),
        "fsdp2": ("train.sharding=fsdp", "train.engine=fsdp"),
    }
    return [
        f"run_dir={root / name}",
        "hardware=cpu",
        "hardware.gpus_per_node=2",
        SEQ_LEN,
        f"train.max_steps={STEPS}",
        "train.batch_size=8",
        "train.logging_steps=1",
        "train.save_steps=2",
        "train.save_total_limit=4",
        "train.eval_steps=1000",
        "train.report_to=[]",
        "method.lora_dropout=0.0",
        f"data.cache_dir={root / 'data-cache'}",
        *(("objective=dpo",) if objective == "dpo" else ()),
        *engines[engine],
    ]


def _stopped_after_the_final_checkpoint_then_run_again(root: Path, objective: str, engine: str) -> None:
    name = f"{objective}-{engine}"
    args = _args(root, name, objective, engine)
    run = root / name
    run_modes(args, run, timeout=RUN_TIMEOUT_S)
    first = json.loads((run / "metrics.json").read_text())["train"]
    assert first["steps"] == STEPS and first["engine"]["world_size"] == 2
    weights = _leave_as_a_stop_after_the_final_checkpoint(run)
    run_modes(args, root / f"{name}-again", timeout=RUN_TIMEOUT_S, modes=("train",))
    again = json.loads((run / "metrics.json").read_text())["train"]
    assert again["steps"] == STEPS and again["step_seconds"] == []  # not one step past max_steps
    assert again["resumed_from"] == str((run / "checkpoints" / f"checkpoint-{STEPS}").resolve())
    # DeepSpeed and FSDP load the final checkpoint into the wrapped model, inside the loop; under DDP it is
    # loaded without training (`callbacks.finish_from_final_checkpoint`), so nothing wraps the model
    wrapper = "PeftModelForCausalLM" if engine == "ddp" else first["engine"]["wrapper"]
    assert again["engine"]["world_size"] == 2 and again["engine"]["wrapper"] == wrapper
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == weights
    assert _checkpoints(run) == ["checkpoint-2", "checkpoint-4"]


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("last-step")


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_sft_resumed_at_its_final_checkpoint_trains_no_step_more(root):
    _stopped_after_the_final_checkpoint_then_run_again(root, "sft", "zero3")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize(
    "objective,engine", [("sft", "ddp"), ("sft", "fsdp2"), ("dpo", "ddp"), ("dpo", "zero3"), ("dpo", "fsdp2")]
)
def test_two_ranks_resumed_at_their_final_checkpoint_train_no_step_more(root, objective, engine):
    _stopped_after_the_final_checkpoint_then_run_again(root, objective, engine)
