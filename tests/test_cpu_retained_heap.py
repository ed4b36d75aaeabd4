"""The CPU plan's retained heap (memory.retained_heap): glibc keeps each adapted projection's freed heap-sized
outputs resident, `retained_adapter_outputs` of them; full fine-tuning and CUDA plans carry none; the
overhead is the fixed share, the working set above the loss and that term (BENCHMARKS.md, "Whole CPU
runs: the peak the process reaches")."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import planned, script_module

from finetune.planner.calibration import Calibration
from finetune.planner.job import make_job, runtime
from finetune.planner.memory import GLIBC_MMAP_THRESHOLD_MAX, retained_heap

CAL = Calibration.default()
GB = 1e9


def _job_and_strategy(*overrides: str):
    cfg, plan = planned(*overrides)
    job = make_job(
        cfg.model, cfg.method, plan.hardware, cfg.train, plan.seq_len, objective=cfg.objective.spec
    )
    return cfg, plan, job, plan.strategy


def test_lora_on_the_cpu_retains_its_projections_outputs():
    # the tiny recipe: 4 layers, LoRA r32 on the seven projections, micro-batch 4 x 256 tokens, fp32 on the CPU
    cfg, plan, job, s = _job_and_strategy("+recipe=tiny")
    assert plan.hardware.device == "cpu" and s.micro_batch_size == 4 and plan.seq_len == 256
    out_dims = 128 + 64 + 64 + 128 + 384 + 384 + 128  # q, k, v, o, gate, up, down of the tiny model
    expected = CAL.cpu.retained_adapter_outputs * 4 * (4 * 256) * out_dims * 4
    assert retained_heap(job, s, runtime(job, s)) == pytest.approx(expected)
    # the overhead: the process, the working set above the loss and the retained outputs (no fluctuating share)
    assert CAL.cpu.allocator_fraction == 0.0
    assert plan.gpu_memory.overhead > CAL.cpu.fixed_gb + expected / GB - 1e-3


def test_full_fine_tuning_and_cuda_retain_nothing():
    _, plan, job, s = _job_and_strategy("+recipe=tiny", "method=full")
    assert retained_heap(job, s, runtime(job, s)) == 0.0
    # full fine-tuning's CPU overhead is the process (with the installed libraries' imports) and the working set
    # above the loss alone
    imports = sum(CAL.cpu.library_imports_gb[name] for name in CAL.installed("cpu"))
    assert plan.gpu_memory.overhead == pytest.approx(CAL.cpu.fixed_gb + imports, abs=0.01)
    _, plan, job, s = _job_and_strategy("+recipe=tiny", "hardware=h100")
    assert plan.hardware.device == "cuda" and CAL.cuda.retained_adapter_outputs == 0.0
    assert retained_heap(job, s, runtime(job, s)) == 0.0


def test_outputs_glibc_maps_apart_are_not_retained():
    """An output of 32 MiB or more is mmapped and given back when freed: at 8,192 tokens on the 8B shape every
    fp32 projection output is, so the term is 0; at 64 tokens none is."""
    _, _, job, s = _job_and_strategy("model=llama3_1_8b", "hardware=cpu", "train.seq_len=8192")
    rt = replace(runtime(job, s), compute=4)
    assert 8192 * job.model.num_kv_heads * job.model.head_dim * 4 >= GLIBC_MMAP_THRESHOLD_MAX
    assert retained_heap(job, replace(s, micro_batch_size=1), rt) == 0.0
    small = replace(job, seq_len=64)
    assert retained_heap(small, replace(s, micro_batch_size=1), rt) > 0


def test_the_bench_fit_reads_the_process_from_full_rows_and_the_share_from_adapter_rows():
    bench = script_module("bench_cpu_malloc")

    def run(row: str, side: str, peak: float, tensors: float, outputs: float) -> dict:
        return {
            "row": row,
            "side": side,
            "peak_gb": peak,
            "tensors_gb": tensors,
            "adapter_outputs_gb": outputs,
        }

    runs = [
        run("sft-full", "default", 0.690, 0.070, 0.0),
        run("dpo-full", "default-2", 0.831, 0.207, 0.0),  # the largest peak beyond the tensors: 0.624
        run("sft-lora", "default", 0.713, 0.063, 0.021),
        run("smollm2", "default", 3.813, 2.195, 0.631),
        run("smollm2", "default-2", 3.800, 2.195, 0.631),  # median peak 3.8065
        run("smollm2", "mmap-4MiB", 3.630, 2.195, 0.631),  # not glibc's default: not fitted
    ]
    fitted = bench.fit(runs, imports=0.0)
    assert fitted["fixed_gb"] == 0.624 and fitted["allocator_fraction"] == 0.0
    # the installed libraries' imports (cpu.library_imports_gb) are their own term: the process is the rest
    assert bench.fit(runs, imports=0.056)["fixed_gb"] == 0.568
    # SmolLM2 asks the most: (0.99 x 3.8065 - 0.624 - 2.195) / 0.631
    assert fitted["retained_adapter_outputs"] == round((0.99 * 3.8065 - 0.624 - 2.195) / 0.631, 2)
