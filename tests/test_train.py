"""Training on the tiny model (CPU): every method learns, state round-trips, invariants hold."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import (
    SEQ_LEN,
    evaluate,
    last_losses,
    plan_for,
    prepare_run,
    run_cli,
    tiny_cfg,
    train_run,
    write_engine,
)

from finetune import rundir
from finetune.data.stage import load_prepared
from finetune.modeling.collator import NUM_TOKENS_KEY, PackedCollator
from finetune.pipeline.cli import compose
from finetune.train import stage
from finetune.train.callbacks import EarlyStop, RunMonitor

# One checkpoint, at the end of the run; the full learning rate from the first step.
STEADY = ("train.save_steps=1000", "train.warmup_ratio=0.0")


def _train(cfg, tiny_data, n_train=None, n_eval=24, **strategy):
    return train_run(cfg, tiny_data, n_train=n_train, n_eval=n_eval, max_generate=8, **strategy)


# ---------------------------------------------------------------- units


def test_collator_pads_packs_and_masks():
    rows = [
        {"input_ids": [1, 5, 6, 1, 7], "labels": [-100, 5, 6, -100, 7], "position_ids": [0, 1, 2, 0, 1]},
        {"input_ids": [1, 8, 9], "labels": [9, 8, 9]},  # a label at position 0 is dropped
    ]
    b = PackedCollator(pad_token_id=0)(rows)
    assert b["input_ids"].tolist() == [[1, 5, 6, 1, 7], [1, 8, 9, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    assert b["labels"].tolist() == [[-100, 5, 6, -100, 7], [-100, 8, 9, -100, -100]]
    assert int(b[NUM_TOKENS_KEY]) == 8 and "attention_mask" not in b


def test_packed_samples_do_not_see_each_other(tiny_cache, tiny_model_cfg):
    """Position ids restarting at a sample make a block-diagonal mask: packed == separate."""
    from finetune.modeling import tiny

    model = tiny.load_model(tiny_model_cfg).eval()
    a, b = [1, 40, 41, 42], [1, 50, 51]
    collate = PackedCollator(pad_token_id=0)
    packed = collate([{"input_ids": a + b, "labels": a + b, "position_ids": [0, 1, 2, 3, 0, 1, 2]}])
    with torch.no_grad():
        joint = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits[0]
        alone = model(input_ids=torch.tensor([b])).logits[0]
    torch.testing.assert_close(joint[4:], alone, rtol=1e-5, atol=1e-5)


def test_early_stop_on_spike_and_on_rising_eval():
    from transformers import TrainerControl, TrainerState

    state, args = TrainerState(), None
    stop = EarlyStop(loss_spike_factor=3.0, eval_rise_patience=2)
    for loss in (2.0, 1.9, 2.1, 2.0):
        control = TrainerControl()
        stop.on_log(args, state, control, logs={"loss": loss})
        assert not control.should_training_stop
    control = TrainerControl()
    stop.on_log(args, state, control, logs={"loss": 7.0})
    assert control.should_training_stop and control.should_save and "spike" in stop.reason

    stop = EarlyStop(loss_spike_factor=0, eval_rise_patience=2)
    for loss, stops in ((1.0, False), (1.1, False), (0.9, False), (1.0, False), (1.2, True)):
        control = TrainerControl()
        stop.on_evaluate(args, state, control, metrics={"eval_loss": loss})
        assert control.should_training_stop == stops
    assert "eval loss rose 2" in stop.reason and control.should_save


def test_early_stop_saves_then_stops_the_trainer(tmp_path, tiny_cache, tiny_data):
    """A (faked) loss spike at step 5 of 30: a checkpoint at step 5, and no step 6."""
    from transformers import TrainerCallback

    from finetune.modeling.loading import load_for_training
    from finetune.modeling.models import load_tokenizer
    from finetune.train.base_trainer import build_trainer

    class Spike(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and state.global_step == 5:
                logs["loss"] = 100.0

    cfg = tiny_cfg(*STEADY, "method=lora", "train.max_steps=30", run_dir=tmp_path / "run")
    plan = plan_for(cfg, micro_batch_size=1, grad_accum_steps=1)
    write_engine(cfg, plan, Path(cfg.run_dir))
    model, dtype = load_for_training(cfg)
    stage.cpu_threads(0)
    stop = EarlyStop(cfg.train.loss_spike_factor, cfg.train.eval_rise_patience)
    train, evals = tiny_data
    trainer = build_trainer(
        cfg,
        plan,
        Path(cfg.run_dir),
        model,
        load_tokenizer(cfg.model),
        train,
        evals.select(range(4)),
        dtype,
        callbacks=[Spike(), stop],
    )
    trainer.train()
    assert trainer.state.global_step == 5 and "spike" in stop.reason
    assert (Path(cfg.run_dir) / "checkpoints" / "checkpoint-5" / "adapter_model.safetensors").is_file()


def test_monitor_logs_throughput_and_memory_against_plan(caplog):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir="unused", logging_steps=1, report_to="none", use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    monitor = RunMonitor("cpu", planned_memory_gb=1e-6, baseline_gb=0.0)
    monitor.on_train_begin(args, state, control)
    monitor.on_step_begin(args, state, control)
    monitor.add_tokens(1000)
    with caplog.at_level("WARNING"):
        monitor.on_step_end(args, state, control)
    assert monitor.warned and "exceeds the plan" in caplog.text
    logs = {"loss": 1.0}
    monitor.on_log(args, state, control, logs=logs)
    assert (
        logs["tokens_per_second"] > 0 and logs["peak_memory_gb"] > 0.01 and logs["planned_memory_gb"] == 0.0
    )
    assert logs["step_seconds"] >= 0


def test_plan_json_round_trip(tmp_path):
    cfg = tiny_cfg(*STEADY, run_dir=tmp_path / "run")
    plan = plan_for(cfg, micro_batch_size=2, grad_accum_steps=3, chunked_loss=True)
    rundir.write_json(tmp_path / rundir.PLAN_FILE, plan.to_dict())
    back = rundir.load_plan(tmp_path)
    assert back.strategy == plan.strategy and back.seq_len == plan.seq_len and back.fits == plan.fits
    assert back.gpu_memory.total == pytest.approx(plan.gpu_memory.total, abs=1e-2)


# ---------------------------------------------------------------- every method learns


@pytest.mark.parametrize(
    "method, overrides",
    [
        ("full", ["method.learning_rate=1e-3", "method.precision=fp32"]),
        ("lora", ["method.learning_rate=5e-3"]),
        ("qlora", ["method.learning_rate=5e-3"]),
    ],
)
def test_method_trains_and_loss_falls(tmp_path, tiny_cache, tiny_data, method, overrides):
    cfg = tiny_cfg(*STEADY, f"method={method}", "train.max_steps=30", *overrides, run_dir=tmp_path / "run")
    m = _train(cfg, tiny_data, micro_batch_size=4, grad_accum_steps=1)
    losses = last_losses(Path(cfg.run_dir))
    assert len(losses) == 30 and m["train"]["steps"] == 30
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.7 * first, losses
    assert m["eval"]["trained"]["loss"] < m["eval"]["base"]["loss"] - 0.5
    t = m["train"]
    assert t["final_loss"] == losses[-1] and t["tokens_per_second"] > 0 and t["tokens"] > 30 * 4 * 64
    assert t["peak_memory_gb"] > 0 and t["planned_memory_gb"] > 0
    saved = json.loads((Path(cfg.run_dir) / "metrics.json").read_text())
    assert saved["train"]["steps"] == 30 and set(saved["eval"]) == {"base", "trained"}
    assert {"loss", "exact_match"} <= set(saved["eval"]["trained"])
    out = Path(cfg.run_dir) / ("model" if method == "full" else "adapter")
    assert (out / ("model.safetensors" if method == "full" else "adapter_model.safetensors")).is_file()
    assert (out / "tokenizer.json").is_file()


# ---------------------------------------------------------------- state and invariants


def test_adapter_and_optimizer_state_save_and_resume_exactly(tmp_path, tiny_cache, tiny_data):
    """A run resumed from its step-6 checkpoint (adapter, optimizer, scheduler, RNG) retraces steps 7-12."""
    from peft import PeftModel

    from finetune.evaluation.heldout import heldout_loss
    from finetune.modeling.models import model_source

    common = ("method=lora", "method.learning_rate=5e-3", "train.max_steps=12", "train.save_steps=6")
    cfg = tiny_cfg(*STEADY, *common, run_dir=tmp_path / "run")
    m = _train(cfg, tiny_data, micro_batch_size=2, grad_accum_steps=2)
    run = Path(cfg.run_dir)
    full = last_losses(run)
    ckpt = run / "checkpoints" / "checkpoint-6"
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    trainable = sum(1 for _ in (ckpt / "adapter_model.safetensors",))
    assert (
        trainable and len(state["state"]) == 2 * 7 * cfg.model.num_layers
    )  # A and B of 7 projections a layer
    assert all({"exp_avg", "exp_avg_sq"} <= set(s) for s in state["state"].values())

    # The saved adapter loads onto the base and reproduces the trained model's held-out loss.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_source(cfg.model), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, run / "adapter").eval()
    evals = tiny_data[1].select(range(24))
    assert heldout_loss(loaded, evals, 0) == pytest.approx(m["eval"]["trained"]["loss"], rel=1e-5)

    # Resume from step 6 in a fresh run directory: the same losses for steps 7-12.
    cfg2 = replace(tiny_cfg(*STEADY, *common, run_dir=tmp_path / "again"), resume=str(ckpt))
    _train(cfg2, tiny_data, micro_batch_size=2, grad_accum_steps=2)
    resumed = last_losses(Path(cfg2.run_dir))
    assert resumed[-6:] == pytest.approx(full[-6:], rel=1e-4)


def test_micro_batch_times_accumulation_invariant(tmp_path, tiny_cache, tiny_data):
    """mb 1 x accumulation 4 == mb 4 x accumulation 1: the loss is the mean over all tokens of the step."""
    common = ("method=lora", "method.lora_dropout=0.0", "method.learning_rate=5e-3", "train.max_steps=6")
    a = tiny_cfg(*STEADY, *common, run_dir=tmp_path / "a")
    _train(a, tiny_data, n_train=48, micro_batch_size=1, grad_accum_steps=4)
    b = tiny_cfg(*STEADY, *common, run_dir=tmp_path / "b")
    _train(b, tiny_data, n_train=48, micro_batch_size=4, grad_accum_steps=1)
    la, lb = last_losses(Path(a.run_dir)), last_losses(Path(b.run_dir))
    assert len(la) == len(lb) == 6
    assert la == pytest.approx(lb, rel=2e-4)
    assert la[-1] < la[0]


def test_chunked_loss_trains_like_the_plain_loss(tmp_path, tiny_cache, tiny_data):
    """Full fine-tuning (trainable head): the chunked loss path gives the same trajectory as the plain one."""
    common = ("method=full", "method.precision=fp32", "method.learning_rate=1e-3", "train.max_steps=5")
    a = tiny_cfg(*STEADY, *common, "train.loss_chunk_size=37", run_dir=tmp_path / "a")
    _train(a, tiny_data, n_train=40, micro_batch_size=2, grad_accum_steps=2, chunked_loss=True)
    b = tiny_cfg(*STEADY, *common, run_dir=tmp_path / "b")
    _train(b, tiny_data, n_train=40, micro_batch_size=2, grad_accum_steps=2, chunked_loss=False)
    la, lb = last_losses(Path(a.run_dir)), last_losses(Path(b.run_dir))
    assert la == pytest.approx(lb, rel=1e-4)


def test_activation_checkpointing_keeps_the_trajectory(tmp_path, tiny_cache, tiny_data):
    """LoRA with non-reentrant checkpointing and the chunked loss trains exactly like the plain path."""
    common = ("method=lora", "method.lora_dropout=0.0", "method.learning_rate=5e-3", "train.max_steps=4")
    a = tiny_cfg(*STEADY, *common, run_dir=tmp_path / "a")
    _train(
        a,
        tiny_data,
        n_train=16,
        micro_batch_size=2,
        grad_accum_steps=2,
        activation_checkpointing=True,
        chunked_loss=True,
    )
    b = tiny_cfg(*STEADY, *common, run_dir=tmp_path / "b")
    _train(b, tiny_data, n_train=16, micro_batch_size=2, grad_accum_steps=2)
    assert last_losses(Path(a.run_dir)) == pytest.approx(last_losses(Path(b.run_dir)), rel=1e-4)


def test_qlora_gradients_after_eval_match_dequantized_reference(tiny_cache, tiny_data, tmp_path):
    """After an eval-mode pass (and generation), QLoRA's LoRA gradients equal those of a dequantized model."""
    import bitsandbytes as bnb
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.modeling.loading import load_for_training, lora_config
    from finetune.modeling.models import model_source

    cfg = tiny_cfg(
        *STEADY,
        "method=qlora",
        "method.lora_dropout=0.0",
        "method.compute_dtype=fp32",
        "method.adapter_dtype=fp32",
        run_dir=tmp_path / "run",
    )
    torch.manual_seed(0)
    model, _ = load_for_training(cfg)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized and all(m.support_avx512bf16_for_cpu is False for m in quantized.values())
    for name, param in model.named_parameters():  # non-zero B so that A's gradients are non-zero too
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)

    batch = PackedCollator(pad_token_id=0)([tiny_data[0][i] for i in range(2)])
    batch.pop(NUM_TOKENS_KEY)
    model.eval()
    with torch.no_grad():
        model(**batch)
        model.generate(input_ids=batch["input_ids"][:1, :12], max_new_tokens=3, do_sample=False)
    model.train()
    model(**batch).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    ref = AutoModelForCausalLM.from_pretrained(model_source(cfg.model), dtype=torch.float32)
    ref_modules = dict(ref.named_modules())
    for name, module in quantized.items():
        w = module.weight
        target = ref_modules[name.replace("base_model.model.", "", 1).replace(".base_layer", "")]
        target.weight.data = (
            bnb.functional.dequantize_4bit(w.data, w.quant_state).float().reshape(target.weight.shape)
        )
    ref = get_peft_model(ref, lora_config(cfg.method, cfg.model))
    ref.load_state_dict({n: p for n, p in model.named_parameters() if "lora_" in n}, strict=False)
    ref.train()
    ref(**batch).loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert set(grads) == set(ref_grads) and len(grads) == 2 * 7 * cfg.model.num_layers
    for name, g in grads.items():
        torch.testing.assert_close(g.float(), ref_grads[name].float(), rtol=1e-3, atol=1e-6, msg=name)


# ---------------------------------------------------------------- the worker entry and the default recipe


@pytest.mark.slow
def test_worker_entry_reads_config_and_plan(tmp_path, tiny_cache):
    where = [f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    run = prepare_run(compose([*where, "train.max_steps=8", SEQ_LEN, "train.report_to=[tensorboard]"]))
    proc = run_cli(str(run), module="finetune.train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["train"]["steps"] == 8 and (run / "adapter" / "adapter_model.safetensors").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    bad = run_cli(str(tmp_path / "nope"), module="finetune.train")
    # The worker reads plan.json first (its hardware profile and layout), then config.yaml.
    assert bad.returncode == 2
    assert f"{tmp_path / 'nope' / 'plan.json'}: missing; run the plan stage" in bad.stderr


@pytest.mark.slow
def test_tiny_recipe_learns_the_bundled_task(tmp_path, tiny_cache):
    """The embedded default as configured: held-out loss falls clearly and exact match rises from ~0."""
    run = prepare_run(compose([f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]))
    cfg = rundir.load_config(run)
    stage.run(cfg, run, rundir.load_plan(run))
    scores = evaluate(cfg, run, load_prepared(run)[1], None)
    base, trained = scores["base"], scores["trained"]
    assert base["exact_match"] < 0.05
    assert trained["exact_match"] > base["exact_match"] + 0.4, trained
    assert trained["loss"] < 0.5 * base["loss"], (base["loss"], trained["loss"])


# ---------------------------------------------------------------- the rank reads what the launcher wrote


def test_a_rank_reads_engine_json_and_refuses_another_world_size(tmp_path, monkeypatch):
    from finetune.core.errors import LaunchError
    from finetune.train.base_trainer import engine_trainer_kwargs

    cfg = tiny_cfg(*STEADY, run_dir=tmp_path / "run")
    plan = plan_for(cfg, micro_batch_size=2, grad_accum_steps=3)
    run = Path(cfg.run_dir)
    with pytest.raises(LaunchError, match=r"engine.json: missing; the launcher writes it"):
        engine_trainer_kwargs(run)
    write_engine(cfg, plan, run)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kwargs = engine_trainer_kwargs(run)
    assert (kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"]) == (2, 3)
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        LaunchError, match=r"set up for 1 process\(es\), this rank's group has 2 \(WORLD_SIZE\)"
    ):
        engine_trainer_kwargs(run)
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # nothing written again


def test_a_rank_the_pipeline_started_does_not_check_again(tmp_path, monkeypatch):
    """The pipeline ran disk, resume, RAM and machine checks before starting the ranks (preflight.handoff);
    a rank started without that promise (launch.sh by hand, SLURM) runs them itself."""
    from finetune.rundir import preflight

    cfg = tiny_cfg(*STEADY, run_dir=tmp_path / "run")
    plan = plan_for(cfg)
    ran = []
    monkeypatch.setattr(preflight, "check", lambda *a, **k: ran.append("check"))
    monkeypatch.setattr(
        preflight, "check_machine", lambda *a, **k: ran.append("machine") or preflight.MachineCheck({})
    )
    for key, value in preflight.handoff(preflight.MachineCheck({}, mismatch="let through")).items():
        monkeypatch.setenv(key, value)
    assert stage._prechecks(cfg, Path(cfg.run_dir), plan).mismatch == "let through" and ran == []
    monkeypatch.delenv(preflight.PRECHECKED_ENV)
    stage._prechecks(cfg, Path(cfg.run_dir), plan)
    assert ran == ["check", "machine"]
