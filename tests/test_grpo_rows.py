"""GRPO's training side is planned on the rows TRL forms (the longest prompt the data stage kept plus
max_completion_length), not on train.seq_len, once the data stage has run; before it, on train.seq_len.
Measured (scripts/bench_grpo_memory.py, BENCHMARKS.md): 8 completions of the bundled prompts train on rows of
36 tokens, and the pipeline's peak grows by what the plan at those rows says a completion adds."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import tiny_cfg

from finetune import rundir
from finetune.pipeline.stages import plan_stage, resolve

GRPO = ("+recipe=tiny_grpo", "train.seq_len=128")


def _stats(run: Path, longest: int) -> None:
    splits = {"train": {"count": 10, "p95": longest - 4, "max": longest}}
    rundir.write_json(
        run / rundir.DATA_STATS_FILE, {"record_kind": "prompts", "splits": splits, "seq_len": 128}
    )


def test_rows_are_the_longest_prompt_plus_the_completion(tmp_path: Path) -> None:
    cfg = resolve(tiny_cfg(*GRPO, run_dir=tmp_path / "run"))
    run = rundir.prepare(cfg)
    before = plan_stage(cfg, run, quiet=True)
    assert before.seq_len == 128
    _stats(run, 41)
    after = plan_stage(cfg, run, quiet=True)
    assert after.seq_len == 41 + cfg.objective.max_completion_length == 49
    assert (
        "GRPO rows: the longest prompt (41 tokens) + max_completion_length (8) = 49 tokens, planned instead of "
        "train.seq_len=128" in after.reasons
    )
    # activations and the loss scale with the row: 49 of 128 tokens
    assert after.gpu_memory.activations < 0.45 * before.gpu_memory.activations
    assert json.loads((run / rundir.PLAN_FILE).read_text())["seq_len"] == 49


def test_a_prompt_as_long_as_seq_len_keeps_seq_len(tmp_path: Path) -> None:
    cfg = resolve(tiny_cfg(*GRPO, run_dir=tmp_path / "run"))
    run = rundir.prepare(cfg)
    _stats(run, 125)
    plan = plan_stage(cfg, run, quiet=True)
    assert plan.seq_len == 128 and not any(r.startswith("GRPO rows") for r in plan.reasons)
