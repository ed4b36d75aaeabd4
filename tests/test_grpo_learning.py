"""GRPO raises the held-out pass rate on the CPU, from a start that is neither 0 nor 1: the target, NOT met.

The start: the tiny recipe's SFT stopped early (60 steps), which answers part of the bundled questions
(greedy exact match 0.59 when this was measured). GRPO (`+recipe=tiny_grpo init_from=SFT_RUN`, 50 steps
of 2 prompts x 4 sampled answers, exact match plus a small one-word format reward) trains on from that
adapter. Both runs are evaluated on the same 64 held-out prompts with the same greedy generation; the
pass rate is exact match. The GRPO run's measured peak (its worker's own VmHWM) is within 5% of the
plan's CPU total.

Measured by hand (2026-12-01, BENCHMARKS.md "GRPO from a partly trained SFT start" and "GRPO pass rate
under sampling"): from 0.594, the recipe's settings drop EOS within 50 steps (completions run to the limit,
pass rate 0.0). Rates of 1e-4 to 5e-4 leave it at 0.578 in 50-200 steps, or collapse the same way later.
With mask_truncated_completions, a KL term to the SFT model, dr_grpo, groups of 8 or 8 prompts a step,
nothing collapses, and the sampled pass rate rises by 0.04. But greedy falls to the start's one answer
per task: that start does not condition on its input. Marked xfail until a start and a setting that
raise it are found. A start that does read its input (the same SFT at 150 steps, greedy 0.79, both classes of
each task answered) was tried too, in three settings (2026-12-02): GRPO lowered it to 0.66-0.75 on 128
held-out prompts, every run answering "positive" to nearly every sentence (BENCHMARKS.md, "GRPO from a tiny
start that reads its input"). The plan-vs-peak check is not met either: the plan at the rows TRL forms is 3-7%
under the pipeline worker's peak, a constant the worker holds beyond the CPU's fixed share.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import child_env, run_cli


def _held_out(run: Path) -> dict[str, str]:
    rows = [json.loads(x) for x in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    return {str(r["prompt"]): str(r["reference"]) for r in rows if r["set"] == "task"}


@pytest.mark.slow
@pytest.mark.extended  # SFT 60 steps, then 50 GRPO steps, each evaluated: about 25 minutes on the shared 2 cores
@pytest.mark.xfail(
    reason="measured: GRPO lowered the held-out pass rate from 0.594 (BENCHMARKS.md)", strict=True
)
def test_grpo_raises_the_held_out_pass_rate_over_its_sft_start(tmp_path: Path) -> None:
    env = child_env(FINETUNE_CACHE=str(tmp_path / "cache"))
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    common = (f"data.cache_dir={tmp_path / 'c'}", "eval.regression=false", "eval.num_samples=64")
    proc = run_cli("+recipe=tiny", f"run_dir={sft}", "train.max_steps=60", *common, env=env, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("+recipe=tiny_grpo", f"run_dir={grpo}", f"init_from={sft}", *common, env=env, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    start = json.loads((sft / "eval" / "metrics.json").read_text())["trained"]["exact_match"]
    after = json.loads((grpo / "eval" / "metrics.json").read_text())["trained"]["exact_match"]
    assert _held_out(sft) == _held_out(grpo) and len(_held_out(grpo)) == 64  # the same questions
    assert 0.0 < start < 1.0
    assert after > start
    train = json.loads((grpo / "metrics.json").read_text())["train"]
    assert train["grpo"]["reward"]["last"] >= train["grpo"]["reward"]["first"]
    assert train["peak_memory_source"] == "process_peak_rss"
    planned, peak = train["planned_memory_gb"], train["peak_memory_gb"]
    assert abs(planned - peak) <= 0.05 * peak
