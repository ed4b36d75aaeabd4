"""The plan's run length from the data stage: with train.max_steps=-1 (epochs) and no train.dataset_tokens, the
plan after mode=data counts the prepared rows (pipeline/stages.py: data_run_length), so `mode=all` and a
`mode=plan` after `mode=data` print hours and cost instead of "no run-length estimate"."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_cfg

from finetune import rundir
from finetune.data import stage as data_stage
from finetune.pipeline.stages import plan_stage, resolve


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_cache):
    tmp = tmp_path_factory.mktemp("run_length")
    cfg = resolve(
        tiny_cfg(
            "hardware=h100",
            "train.max_steps=-1",
            "train.epochs=2",
            f"data.cache_dir={tmp / 'cache'}",
            run_dir=tmp / "run",
        )
    )
    run = rundir.prepare(cfg)
    rundir.save_config(cfg, run)
    data_stage.run(cfg, run)
    return cfg, run, json.loads((run / rundir.DATA_STATS_FILE).read_text())


def test_the_plan_counts_the_prepared_rows_an_epoch(prepared):
    cfg, run, stats = prepared
    rows, seq_len = stats["packing"]["bins"], stats["seq_len"]
    assert stats["packing"]["enabled"] and rows > 0
    plan = plan_stage(cfg, run, quiet=True)
    est = plan.estimate
    assert est.tokens_per_second and est.run_hours is not None
    assert est.run_hours == pytest.approx(2 * rows * seq_len / est.tokens_per_second / 3600, rel=1e-9)
    assert (
        f"run length: 2 epoch(s) of the data stage's {rows:,} packed rows x {seq_len} tokens = "
        f"{rows * seq_len:,} tokens an epoch (data_stats.json; train.dataset_tokens overrides it)"
    ) in plan.reasons
    saved = json.loads((run / rundir.PLAN_FILE).read_text())
    assert saved["estimate"]["run_hours"] is not None  # plan.json rounds it: 0.0 for the tiny model


def test_a_given_length_wins_over_the_data_stage(prepared):
    cfg, run, _ = prepared
    from dataclasses import replace

    given = replace(cfg, train=replace(cfg.train, dataset_tokens=1_000_000))
    plan = plan_stage(given, run, quiet=True)
    assert plan.estimate.run_hours == pytest.approx(2 * 1_000_000 / plan.estimate.tokens_per_second / 3600)
    assert not any(r.startswith("run length:") for r in plan.reasons)
    steps = replace(cfg, train=replace(cfg.train, max_steps=10))
    assert not any(r.startswith("run length:") for r in plan_stage(steps, run, quiet=True).reasons)


def test_without_the_data_stage_the_plan_says_how_to_get_a_length(tmp_path, tiny_cache):
    cfg = resolve(tiny_cfg("hardware=h100", "train.max_steps=-1", run_dir=tmp_path / "run"))
    run = rundir.prepare(cfg)
    plan = plan_stage(cfg, run, quiet=True)
    assert plan.estimate.run_hours is None
    assert (
        "no run-length estimate: set train.max_steps or train.dataset_tokens, or run mode=data first"
        in plan.reasons
    )
