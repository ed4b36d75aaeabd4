"""Engine settings from the plan, validated by the engines' own parsers (DeepSpeed, accelerate, transformers)."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from helpers import planned

from finetune import rundir
from finetune.core.composition import compose, load_profiles
from finetune.core.config import Config, LaunchConfig
from finetune.launch.engines import layout, nccl_env, write_engine_files
from finetune.planner import Plan, make_plan


@pytest.fixture(scope="module")
def llama70b_full() -> tuple[Config, Plan]:
    return planned("+recipe=llama70b_full")


def parse_deepspeed(path: Path, world_size: int, monkeypatch: pytest.MonkeyPatch):
    """DeepSpeed's own parser, as a rank of `world_size` would run it (no process group needed)."""
    from deepspeed.runtime import config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda group=None: 0)
    # A dict: given a path, DeepSpeed's loader leaves the file open (a ResourceWarning, an error here).
    return ds_config.DeepSpeedConfig(json.loads(path.read_text()))


def no_auto(obj) -> bool:
    if isinstance(obj, dict):
        return all(no_auto(v) for v in obj.values())
    if isinstance(obj, list):
        return all(no_auto(v) for v in obj)
    return obj != "auto"


def test_llama70b_full_is_zero3_with_optimizer_offload_on_8xh200(tmp_path, llama70b_full, monkeypatch):
    cfg, plan = llama70b_full
    assert plan.fits and plan.strategy.sharding == "zero3" and plan.strategy.offload_optimizer
    files = write_engine_files(cfg, plan, tmp_path)
    assert files.engine == "deepspeed" and files.world_size == 8 and files.accelerate_config is None
    raw = json.loads(files.deepspeed.read_text())
    assert no_auto(raw)
    s = plan.strategy
    ds = parse_deepspeed(files.deepspeed, 8, monkeypatch)
    assert ds.zero_optimization_stage == 3
    assert ds.train_micro_batch_size_per_gpu == s.micro_batch_size
    assert ds.gradient_accumulation_steps == s.grad_accum_steps
    assert ds.train_batch_size == s.micro_batch_size * s.grad_accum_steps * 8 == cfg.train.batch_size
    assert ds.gradient_clipping == cfg.train.max_grad_norm
    assert ds.bfloat16_config.enabled is True
    assert ds.zero_config.offload_optimizer.device == "cpu" and ds.zero_config.offload_optimizer.pin_memory
    assert ds.zero_config.offload_param is None
    assert ds.zero_config.overlap_comm and ds.zero_config.contiguous_gradients
    assert ds.zero_config.gather_16bit_weights_on_model_save is True
    assert ds.zero_config.reduce_bucket_size == cfg.model.hidden_size**2
    # ZeRO-Offload runs DeepSpeed's CPU Adam with the method's learning rate.
    assert ds.optimizer_name == "adamw" and ds.optimizer_params["lr"] == cfg.method.learning_rate


def test_parameter_offload_and_a_wrong_world_size_is_caught(tmp_path, llama70b_full, monkeypatch):
    cfg, plan = llama70b_full
    plan = replace(plan, strategy=replace(plan.strategy, offload_params=True))
    files = write_engine_files(cfg, plan, tmp_path)
    ds = parse_deepspeed(files.deepspeed, 8, monkeypatch)
    assert ds.zero_config.offload_param.device == "cpu"
    # The file is for 8 ranks: DeepSpeed itself refuses it on 4 (so the batch numbers are really checked).
    with pytest.raises(AssertionError, match="train_batch_size"):
        parse_deepspeed(files.deepspeed, 4, monkeypatch)


def test_deepspeed_json_agrees_with_the_trainer_kwargs(tmp_path, llama70b_full):
    """HF's integration compares the JSON with TrainingArguments and refuses mismatches: there must be none."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    cfg, plan = llama70b_full
    files = write_engine_files(cfg, plan, tmp_path)
    kw = files.trainer_kwargs
    assert kw["deepspeed"] == str(files.deepspeed)
    args = SimpleNamespace(
        world_size=files.world_size,
        fp16=False,
        fp16_full_eval=False,
        bf16_full_eval=False,
        save_on_each_node=False,
        **{k: v for k, v in kw.items() if k != "deepspeed"},
    )
    hf = HfTrainerDeepSpeedConfig(json.loads(files.deepspeed.read_text()))
    hf.trainer_config_process(args)
    assert hf.mismatches == []


def test_cpu_two_process_zero3_is_fp32_unpinned_and_says_use_cpu(tmp_path, monkeypatch):
    cfg, plan = planned(
        "hardware.gpus_per_node=2",
        "train.sharding=zero3",
        "train.engine=zero3",
        "train.offload_optimizer=true",
    )
    files = write_engine_files(cfg, plan, tmp_path)
    ds = parse_deepspeed(files.deepspeed, 2, monkeypatch)
    assert ds.bfloat16_config.enabled is False  # bf16 is slow on the CPU: method.precision=auto is fp32 there
    assert ds.zero_config.offload_optimizer.pin_memory is False
    assert files.trainer_kwargs["use_cpu"] is True  # gives the gloo group (without it each rank trains alone)
    env = nccl_env(LaunchConfig(), layout(plan))
    # The other trap: under ACCELERATE_USE_CPU accelerate drops DeepSpeed and runs DDP (test_distributed.py).
    assert "ACCELERATE_USE_CPU" not in env


def load_accelerate(path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # accelerate's loader leaves a file handle open
        return load_config_from_file(str(path))


def accelerate_launch_env(path: Path, *extra: str) -> dict[str, str]:
    """What `accelerate launch --config_file PATH` would export to the ranks."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(path), *extra, "-m", "finetune.train", "RUN"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        args, _, _ = _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


def test_fsdp2_accelerate_config_loads_and_reaches_the_plugin(tmp_path, monkeypatch):
    cfg, plan = planned("+recipe=llama70b_full", "train.engine=fsdp")
    assert plan.strategy.sharding == "fsdp"
    launch = LaunchConfig(launcher="accelerate", nnodes=2, master_addr="10.0.0.1", master_port=29400)
    files = write_engine_files(cfg, plan, tmp_path, launch)
    assert (
        files.engine == "fsdp"
        and files.deepspeed is None
        and files.accelerate_config.name == "accelerate_fsdp.yaml"
    )
    loaded = load_accelerate(files.accelerate_config)
    assert loaded.distributed_type.value == "FSDP"
    assert (loaded.num_processes, loaded.num_machines, loaded.machine_rank) == (16, 2, 0)
    assert (loaded.main_process_ip, loaded.main_process_port) == ("10.0.0.1", 29400)
    assert loaded.mixed_precision == "bf16"
    fc = loaded.fsdp_config
    assert fc["fsdp_version"] == 2 and fc["fsdp_reshard_after_forward"] is True
    assert fc["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fc["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert fc["fsdp_activation_checkpointing"] is True and fc["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fc["fsdp_offload_params"] is True  # the plan offloads the optimizer; FSDP2 offloads both

    env = accelerate_launch_env(files.accelerate_config, "--machine_rank", "1")
    assert env["FSDP_VERSION"] == "2" and env["ACCELERATE_USE_FSDP"] == "true"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.activation_checkpointing is True
    assert str(plugin.state_dict_type).endswith("SHARDED_STATE_DICT")


def test_fsdp_trainer_kwargs_match_the_accelerate_file(tmp_path):
    cfg, plan = planned("+recipe=qwen32b_full", "train.engine=fsdp")
    if plan.strategy.sharding != "fsdp":
        pytest.skip(f"qwen32b_full plans {plan.strategy.sharding}")
    files = write_engine_files(cfg, plan, tmp_path)
    kw = files.trainer_kwargs
    # FSDP checkpoints the wrapped layers itself; the Trainer's own checkpointing stays off.
    assert kw["fsdp"] is True and kw["activation_checkpointing"] is False
    fc = kw["fsdp_config"]
    acc = yaml.safe_load(files.accelerate_config.read_text())["fsdp_config"]
    assert (
        fc["transformer_layer_cls_to_wrap"]
        == [acc["fsdp_transformer_layer_cls_to_wrap"]]
        == ["Qwen2DecoderLayer"]
    )
    assert fc["activation_checkpointing"] == acc["fsdp_activation_checkpointing"]
    assert fc["cpu_offload"] == acc["fsdp_offload_params"]
    assert fc["version"] == 2 and fc["state_dict_type"] == "SHARDED_STATE_DICT"


def test_zero3_under_accelerate_points_at_the_json(tmp_path, llama70b_full, monkeypatch):
    cfg, plan = llama70b_full
    files = write_engine_files(cfg, plan, tmp_path, LaunchConfig(launcher="accelerate"))
    loaded = load_accelerate(files.accelerate_config)
    assert loaded.distributed_type.value == "DEEPSPEED" and loaded.num_processes == 8
    assert loaded.deepspeed_config["deepspeed_config_file"] == str(files.deepspeed)
    env = _deepspeed_launch_env(files.accelerate_config)
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(files.deepspeed)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()  # what each rank builds from that environment
    assert (
        plugin.zero_stage == 3
        and plugin.hf_ds_config.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    )


def _deepspeed_launch_env(path: Path) -> dict[str, str]:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "finetune.train", "RUN"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        args, defaults, mp_from_config = _validate_launch_command(args)
    # As accelerate's launch_command does before its DeepSpeed launcher.
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return env


def test_ddp_and_single_write_no_engine_file(tmp_path):
    cfg, plan = planned("+recipe=llama70b_lora")
    files = write_engine_files(cfg, plan, tmp_path)
    assert plan.strategy.sharding in ("ddp", "fsdp", "zero3")
    if plan.strategy.sharding == "ddp":
        assert files.engine == "ddp" and files.deepspeed is None and files.accelerate_config is None
    cfg, plan = planned("+recipe=tiny")
    files = write_engine_files(cfg, plan, tmp_path / "tiny")
    assert files.engine == "single" and files.world_size == 1 and "deepspeed" not in files.trainer_kwargs


def test_engine_files_from_the_run_dir_match_the_plan_object(tmp_path, llama70b_full):
    """config.yaml + plan.json read back from the run dir write the same engine files as the Plan object, and
    engine.json (what each rank reads) says the same."""
    cfg, plan = llama70b_full
    rundir.save_config(cfg, tmp_path)
    rundir.write_json(tmp_path / rundir.PLAN_FILE, plan.to_dict())
    from_dict = write_engine_files(
        rundir.load_config(tmp_path), rundir.load_plan(tmp_path), tmp_path
    ).to_dict()
    text = (tmp_path / "deepspeed.json").read_text()
    from_plan = write_engine_files(cfg, plan, tmp_path).to_dict()
    assert from_dict == from_plan == rundir.load_engine(tmp_path)
    assert from_dict["engine"] == "deepspeed" and from_dict["deepspeed"] == str(
        (tmp_path / "deepspeed.json").resolve()
    )
    assert (tmp_path / "deepspeed.json").read_text() == text  # idempotent: every rank may call it


# ---------------------------------------------------------------- every rung on every profile


def _rungs(overrides: list[str], profile: str) -> tuple[Config, list]:
    """Every strategy the planner may emit for the job on the profile (finetune.planner.candidates)."""
    from finetune.planner import candidates, make_job

    cfg = compose([*overrides, f"hardware={profile}", "method.optimizer=null"])
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.train.seq_len)
    found, _ = candidates(job)
    return cfg, found


JOBS = [
    ["+recipe=llama70b_full", "train.engine=zero3"],
    ["+recipe=llama70b_full", "train.engine=fsdp"],
    ["+recipe=llama70b_lora", "train.engine=fsdp"],
    ["+recipe=llama70b_lora", "train.engine=zero3"],
    ["+recipe=llama8b_qlora"],
]
GPU_PROFILES = sorted(
    name for name, p in load_profiles().items() if p.device == "cuda" and p.gpu_memory_gb is not None
)


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_every_rung_on_every_profile_gets_the_engine_settings_it_plans(tmp_path, profile):
    """The planner's candidates (every strategy it may emit) written as engine files: the engine, its offload,
    optimizer, checkpointing and batch numbers are the plan's, one for one; nothing is substituted."""
    from transformers.training_args import OptimizerNames

    from finetune.train.base_trainer import optimizer_name

    engines = {"none": "single", "ddp": "ddp", "fsdp": "fsdp", "zero3": "deepspeed"}
    seen = set()
    for overrides in JOBS:
        cfg, rungs = _rungs(overrides, profile)
        assert rungs, (overrides, profile)
        gpus = cfg.hardware.total_gpus
        made = make_plan(cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, load_profiles())
        for s in rungs:
            plan = replace(made, strategy=s)  # the rung as a plan.json would carry it
            files = write_engine_files(cfg, plan, tmp_path)
            kw = files.trainer_kwargs
            engine = engines[s.sharding] if s.sharding != "none" or gpus == 1 else "ddp"
            assert files.engine == engine, s
            seen.add((files.engine, s.offload_optimizer, s.offload_params, s.optimizer))
            assert kw["per_device_train_batch_size"] == s.micro_batch_size
            assert kw["gradient_accumulation_steps"] == s.grad_accum_steps
            if files.engine == "deepspeed":
                ds = json.loads(files.deepspeed.read_text())
                zero = ds["zero_optimization"]
                assert ("offload_optimizer" in zero) is s.offload_optimizer
                assert ("offload_param" in zero) is s.offload_params
                # DeepSpeed's own CPU Adam exactly when the plan offloads the optimizer (the plan's adamw);
                # otherwise the Trainer's optimizer, the plan's, runs inside ZeRO-3
                assert ("optimizer" in ds) is s.offload_optimizer
                assert not s.offload_optimizer or s.optimizer == "adamw"
                assert kw["activation_checkpointing"] is s.activation_checkpointing
            elif files.engine == "fsdp":
                fc = kw["fsdp_config"]
                assert fc["cpu_offload"] is s.offload_params is s.offload_optimizer  # CPUOffloadPolicy: both
                assert fc["activation_checkpointing"] is s.activation_checkpointing
                assert kw["activation_checkpointing"] is False
                assert s.optimizer == "adamw"  # no 8-bit states under FSDP2
            else:
                assert not (s.offload_optimizer or s.offload_params)  # these engines offload nothing
                assert kw["activation_checkpointing"] is s.activation_checkpointing
                assert "deepspeed" not in kw and "fsdp" not in kw
            if not s.offload_optimizer:
                assert optimizer_name(s.optimizer, "cuda") in {o.value for o in OptimizerNames}
    assert any(e in ("deepspeed", "fsdp") for e, *_ in seen) or gpus == 1


@pytest.mark.parametrize(
    "sharding,changes,needle",
    [
        ("fsdp", dict(optimizer="adamw_8bit"), "does not run under train.sharding=fsdp"),
        (
            "fsdp",
            dict(offload_optimizer=True),
            "FSDP2 offloads parameters, gradients and optimizer state together",
        ),
        (
            "zero3",
            dict(offload_optimizer=True, optimizer="adamw_8bit"),
            "ZeRO-3 offloads only its own fp32 CPU Adam",
        ),
        ("ddp", dict(offload_optimizer=True), "data parallel replicates the whole state"),
    ],
)
def test_a_hand_edited_plan_the_engine_cannot_run_is_refused(
    tmp_path, llama70b_full, sharding, changes, needle
):
    from finetune.core.errors import LaunchError

    cfg, plan = llama70b_full
    edited = replace(
        plan,
        strategy=replace(
            plan.strategy,
            **{"sharding": sharding, "offload_optimizer": False, "offload_params": False, **changes},
        ),
    )
    with pytest.raises(LaunchError, match=needle):
        write_engine_files(cfg, edited, tmp_path)
    assert not (tmp_path / "deepspeed.json").exists() and not (tmp_path / "accelerate_fsdp.yaml").exists()
