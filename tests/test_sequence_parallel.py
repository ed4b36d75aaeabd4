"""Long context. A sequence split (DeepSpeed's Ulysses, torch's ring) and activation offloading,
planned term by term, refused where the libraries cannot combine them, written into engine.json and
SFTConfig, and, for Ulysses on two CPU ranks, the same loss and gradients as one rank on the whole sequence
with about half the activations each."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import REPO, child_env

from finetune.core.composition import compose, load_profiles
from finetune.core.config import Config, ModelConfig
from finetune.core.errors import ConfigError
from finetune.core.parallelism import SEQUENCE_SPLITS, Mesh
from finetune.launch.engines import write_engine_files
from finetune.planner import Plan, Strategy, make_job, make_plan, memory, runtime
from finetune.planner.activations import LayerRun, LayerShape, layer_bytes_per_token
from finetune.planner.job import rank_tokens
from finetune.planner.step import split_saved_per_token

PROFILES = load_profiles()
FLASH = "train.attention=flash"  # Ulysses keeps packed rows apart only under flash attention


def planned(*overrides: str) -> tuple[Config, Plan]:
    """helpers.planned, with the data's packing (what the pipeline's plan stage passes)."""
    from finetune.pipeline.stages import resolve

    cfg = resolve(compose(list(overrides)))
    plan = make_plan(
        cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES, packing=cfg.data.packing
    )
    return cfg, plan


def plan_for(*overrides: str) -> tuple[Config, Plan]:
    cfg = compose(["mode=plan", "train.batch_size=8", *overrides])
    plan = make_plan(
        cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.plan, PROFILES, packing=cfg.data.packing
    )
    return cfg, plan


# ---------------------------------------------------------------- the three long-context cases


def test_8b_lora_at_128k_on_8xh100_splits_the_sequence_and_says_which_term_forced_it():
    cfg, plan = plan_for("+recipe=llama8b_lora", "hardware=h100x8", "train.seq_len=131072", FLASH)
    s = plan.strategy
    assert plan.fits and s.split is SEQUENCE_SPLITS["ulysses"] and s.sharding == "zero3"
    assert s.sequence_parallel > 1 and 32 % s.sequence_parallel == 0 and 8 % s.sequence_parallel == 0
    assert plan.layout.mesh == Mesh(shard=8 // s.sequence_parallel, sequence=s.sequence_parallel)
    whole, _ = memory(_job(cfg, plan), replace(s, sequence_parallel=1))
    assert whole.total > plan.usable_gpu_memory_gb >= plan.gpu_memory.total
    # the split divides the activations by its degree (each rank's tokens), not the weights; under flash-attn
    # neither keeps a mask (the rows are flattened)
    split_share = whole.activations / s.sequence_parallel
    assert plan.gpu_memory.activations == pytest.approx(split_share, rel=1e-9)
    assert plan.gpu_memory.logits < whole.logits
    assert plan.gpu_memory.weights == pytest.approx(whole.weights)
    line = next(r for r in plan.reasons if r.startswith("sequence split: DeepSpeed Ulysses"))
    # flash-attn keeps no [T, T] mask: what the split divides most is the backward's working set (overhead)
    assert "does not fit in 72.0 GB" in line and "the term it divides: overhead" in line
    d = plan.to_dict()["strategy"]
    assert (d["sequence_parallel"], d["sequence_split"]) == (s.sequence_parallel, "ulysses")
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).strategy == s


def test_8b_lora_at_128k_with_packed_rows_under_sdpa_names_the_way_out():
    _, plan = plan_for(
        "+recipe=llama8b_lora", "hardware=h100x8", "train.seq_len=131072", "train.attention=sdpa"
    )
    assert not plan.fits and plan.strategy.sequence_parallel == 1
    assert any(
        r.startswith("train.attention=flash fits: DeepSpeed Ulysses (ALST) over") for r in plan.suggestions
    )


def test_8b_at_32k_on_one_h200_needs_no_split_and_says_so():
    _, plan = plan_for("+recipe=llama8b_lora", "hardware=h200", "train.seq_len=32768")
    assert plan.fits and plan.strategy.sequence_parallel == 1 and plan.layout.mesh.sequence == 1
    assert any(
        r.startswith("sequence split: none needed, each 32,768-token sequence fits") for r in plan.reasons
    )


def test_70b_qlora_at_32k_on_8xh100_splits_under_flash_and_offloads_activations_without():
    _, split = plan_for("+recipe=llama70b_qlora", "hardware=h100x8", "train.seq_len=32768", FLASH)
    assert split.fits and split.strategy.split is not None
    assert any("the term it divides: activations" in r for r in split.reasons)
    _, offload = plan_for("+recipe=llama70b_qlora", "hardware=h100x8", "train.seq_len=32768")
    assert offload.fits and offload.strategy.split is None and offload.strategy.activation_offloading
    assert any(r.startswith("activation offloading to host memory:") for r in offload.reasons)


def test_a_fixed_degree_is_honoured():
    _, plan = plan_for(
        "+recipe=llama8b_lora", "hardware=h100x8", "train.seq_len=131072", FLASH, "train.sequence_parallel=8"
    )
    assert plan.strategy.sequence_parallel == 8 and plan.layout.mesh == Mesh(shard=1, sequence=8)


# ---------------------------------------------------------------- what the engines cannot combine


@pytest.mark.parametrize(
    "overrides, words",
    [
        (("train.sequence_parallel=3",), "train.sequence_parallel=3 must divide the 8 GPUs"),
        (
            (
                "model=tiny",
                "train.seq_len=1024",
                "train.sequence_parallel=8",
                "train.sequence_split=ulysses",
                FLASH,
            ),
            "4 query and 2 key/value heads do not divide by 8",
        ),
        (
            ("train.sequence_parallel=2", "train.sequence_split=ring", FLASH),
            "packed samples would attend across their boundaries (data.packing=false)",
        ),
        (
            ("train.sequence_parallel=2", "train.sequence_split=ulysses"),
            "(train.attention=flash or data.packing=false)",
        ),
        (
            (
                "train.sequence_parallel=2",
                "train.sequence_split=ring",
                "data.packing=false",
                "train.sharding=zero3",
            ),
            "ring context parallelism runs under FSDP2 (train.sharding=fsdp)",
        ),
        (
            ("train.sequence_parallel=2", "train.sequence_split=ulysses", FLASH, "train.sharding=fsdp"),
            "Ulysses runs under DeepSpeed (train.sharding=zero3)",
        ),
        (
            ("train.activation_offloading=true", "train.activation_checkpointing=false"),
            "it needs train.activation_checkpointing=true",
        ),
    ],
)
def test_what_the_engine_cannot_combine_is_refused_in_one_line(overrides, words):
    from finetune.core.errors import PlanError

    with pytest.raises(PlanError) as err:
        plan_for("+recipe=llama8b_lora", "hardware=h100x8", "train.seq_len=32768", *overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_ring_does_not_run_on_the_cpu():
    from finetune.core.errors import PlanError

    with pytest.raises(PlanError, match=r"train.sequence_split=ring does not run on the CPU"):
        planned(
            "hardware.gpus_per_node=2", "train.sequence_parallel=2", "train.sequence_split=ring",
            "train.sharding=fsdp", "data.packing=false", "train.seq_len=128",
        )  # fmt: skip


def test_an_unknown_split_and_a_zero_degree_are_config_errors():
    with pytest.raises(ConfigError, match="train.sequence_split"):
        compose(["train.sequence_split=stripes"])
    with pytest.raises(ConfigError, match="train.sequence_parallel"):
        compose(["train.sequence_parallel=0"])


# ---------------------------------------------------------------- engine.json and SFTConfig


def test_ulysses_plan_writes_sp_size_into_engine_json_and_a_data_parallel_batch(tmp_path, monkeypatch):
    from finetune.train.base_trainer import parallelism_config

    cfg, plan = planned(
        "hardware.gpus_per_node=2", "train.sharding=zero3", "train.sequence_parallel=2",
        "train.sequence_split=ulysses", "data.packing=false", "train.seq_len=128", "train.batch_size=4",
    )  # fmt: skip
    files = write_engine_files(cfg, plan, tmp_path)
    engine = json.loads((tmp_path / "engine.json").read_text())
    assert engine["parallelism"] == {
        "kwargs": {"sp_size": 2, "sp_backend": "deepspeed"}, "split": "ulysses", "attention": "sdpa",
        "seq_len": 128,
    }  # fmt: skip
    ds = json.loads(files.deepspeed.read_text())
    s = plan.strategy
    # the two ranks share each sequence: one data-parallel rank; the JSON counts every rank, as zero.Init and
    # the Trainer check it (accelerate rewrites it for the data-parallel ranks before deepspeed.initialize)
    assert s.micro_batch_size * s.grad_accum_steps == 4
    assert ds["train_batch_size"] == s.micro_batch_size * s.grad_accum_steps * 2
    pc = parallelism_config(engine["parallelism"])
    assert (pc.sp_size, pc.sp_backend, pc.sp_handler.sp_attn_implementation) == (2, "deepspeed", "sdpa")
    assert pc.sp_handler.sp_seq_length_is_variable is True


def test_ring_plan_writes_cp_size_with_fsdp2(tmp_path):
    cfg, plan = plan_for(
        "+recipe=llama8b_lora", "hardware=h100x8", "train.seq_len=131072", "train.sequence_split=ring",
        "train.sequence_parallel=4", "train.sharding=fsdp", "data.packing=false",
    )  # fmt: skip
    assert plan.strategy.split is SEQUENCE_SPLITS["ring"]
    files = write_engine_files(cfg, plan, tmp_path)
    assert files.parallelism is not None
    assert files.parallelism["kwargs"] == {"cp_size": 4, "cp_backend": "torch", "dp_shard_size": 2}
    assert files.trainer_kwargs["fsdp"] is True


def test_activation_offloading_is_counted_and_reaches_the_trainer(tmp_path):
    """On the CPU TRL's activation offloading moves nothing (the tensors are in host memory already): the plan
    counts it (host memory up, activations down on a GPU profile) and SFTConfig gets the argument."""
    from finetune import rundir
    from finetune.train.sft_trainer import build_config as build_sft_config

    cfg, on = plan_for(
        "+recipe=llama8b_lora", "hardware=h200", "train.seq_len=65536", "train.activation_checkpointing=true",
        "train.activation_offloading=true",
    )  # fmt: skip
    assert on.strategy.activation_offloading
    job, off = _job(cfg, on), replace(on.strategy, activation_offloading=False)
    mem_on, host_on = memory(job, on.strategy)
    mem_off, host_off = memory(job, off)
    # each checkpointed layer input (bf16, hidden 4,096) of all but 2 of the 32 layers goes to host memory
    moved = (32 - 2) * 4096 * 2 * 65536
    assert host_on - host_off == pytest.approx(moved, rel=1e-9)
    assert (mem_off.activations - mem_on.activations) * 1e9 == pytest.approx(moved, rel=1e-9)
    assert any(r.startswith("time: activation offloading's PCIe round trip") for r in on.reasons)
    cfg, plan = planned("train.activation_checkpointing=true", "train.activation_offloading=true")
    assert plan.strategy.activation_offloading
    run = tmp_path / "run"
    run.mkdir()
    rundir.save_config(cfg, run)
    write_engine_files(cfg, plan, run)
    import torch

    args = build_sft_config(cfg, plan, run, torch.float32)
    assert args.activation_offloading is True


# ---------------------------------------------------------------- two CPU ranks: the same training


def _run_worker(tmp_path: Path, ranks: int, dtype: str, seq_len: int = 512) -> dict:
    out = tmp_path / f"sp{ranks}_{dtype}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(REPO / "scripts" / "sequence_parallel_worker.py"), "--out", str(out), "--dtype", dtype,
        "--seq-len", str(seq_len),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, env=child_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _planned_layer_bytes(result: dict, degree: int) -> float:
    """The planner's bytes for the worker's second decoder layer on one rank (full fine-tuning, every
    parameter in the worker's dtype, no mask: Ulysses drops it)."""
    sh = result["shape"]
    model = ModelConfig(
        name="sp-worker", hidden_size=sh["hidden_size"], num_layers=sh["num_hidden_layers"],
        num_heads=sh["num_attention_heads"], num_kv_heads=sh["num_key_value_heads"], head_dim=sh["head_dim"],
        intermediate_size=sh["intermediate_size"], vocab_size=sh["vocab_size"],
        max_position_embeddings=sh["max_position_embeddings"],
    )  # fmt: skip
    cfg = compose(["method=full", f"train.seq_len={result['seq_len']}", "hardware.gpus_per_node=2"])
    job = make_job(model, cfg.method, cfg.hardware, cfg.train, result["seq_len"])
    s = Strategy(sharding="zero3", micro_batch_size=1, sequence_parallel=degree)
    dtype_bytes = 4 if result["dtype"] == "fp32" else 2
    rt = replace(runtime(job, s), compute=dtype_bytes)
    per_token = layer_bytes_per_token(LayerShape.of(model), LayerRun("full", dtype_bytes=dtype_bytes))
    return (per_token + split_saved_per_token(job, s, rt)) * rank_tokens(job, s)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("dtype, loss_tol, grad_tol", [("fp32", 1e-6, 1e-5), ("bf16", 1e-3, 1e-2)])
def test_ulysses_on_two_cpu_ranks_matches_one_rank_with_half_the_activations(
    tmp_path, dtype, loss_tol, grad_tol
):
    import torch

    one, two = _run_worker(tmp_path, 1, dtype), _run_worker(tmp_path, 2, dtype)
    assert two["rank_tokens"] == one["seq_len"] // 2
    assert two["loss"] == pytest.approx(one["loss"], rel=loss_tol)
    g1, g2 = torch.tensor(one["grads"]), torch.tensor(two["grads"])
    assert g1.abs().max() > 0
    assert (g1 - g2).abs().max() <= grad_tol * g1.abs().max()  # relative to the largest gradient
    whole = one["layer_saved_bytes"][0]
    for share in two["layer_saved_bytes"]:
        assert 0.45 * whole <= share <= 0.6 * whole  # about half (Ulysses keeps one query-wide tensor more)
    # the planner's per-rank figure within 5% of what each rank saved
    for degree, result in ((1, one), (2, two)):
        for share in result["layer_saved_bytes"]:
            assert _planned_layer_bytes(result, degree) == pytest.approx(share, rel=0.05)


def _job(cfg: Config, plan: Plan):
    return make_job(cfg.model, cfg.method, plan.hardware, cfg.train, plan.seq_len, None, cfg.plan)


def test_metrics_record_the_split_as_accelerate_ran_it():
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    from finetune.train.throughput import sequence_split_record

    base = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))

    def trainer(pc, index):
        return SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=pc, process_index=index))

    ulysses = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    assert sequence_split_record(trainer(ulysses, 3), base) == {
        "sp_size": 2, "backend": "deepspeed", "attention": "flash_attention_2", "rank_in_split": 1,
        "share_of_each_sequence": "tokens [1/2, 2/2) of each sequence",
    }  # fmt: skip
    assert sequence_split_record(trainer(None, 0), base) is None
    assert sequence_split_record(trainer(ParallelismConfig(dp_shard_size=2), 0), base) is None
