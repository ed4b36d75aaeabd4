"""The embedded default end to end (slow): data -> plan -> train -> eval -> export -> serve.sh,
with the fine-tuned and merged models beating the base on the bundled task."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import write_engine


@pytest.mark.slow
def test_tiny_pipeline_trained_and_merged_beat_the_base(tmp_path, tiny_cache):
    from finetune.core.config.evaluation import EvalConfig
    from finetune.data import stage as data_stage
    from finetune.evaluation import stage as eval_stage
    from finetune.export import stage as export_stage
    from finetune.pipeline import stages
    from finetune.pipeline.cli import compose
    from finetune.train import stage as train_stage

    run = tmp_path / "run"
    cfg = replace(
        compose([f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "train.report_to=[]"]),
        eval=EvalConfig(num_samples=64, max_new_tokens=8, progress=False),
    )
    cfg = stages.resolve(cfg)
    data_stage.run(cfg, run)
    plan = stages.plan_stage(cfg, run, quiet=True)
    write_engine(cfg, plan, run)  # as the launcher writes them
    train_stage.run(cfg, run, plan)
    eval_stage.run(cfg, run)
    export_stage.run(cfg, run, plan)

    doc = json.loads((run / "eval" / "metrics.json").read_text())
    base, trained, merged = doc["base"], doc["trained"], doc["merged"]
    assert trained["loss"] < base["loss"] and merged["loss"] == pytest.approx(trained["loss"], abs=1e-4)
    assert trained["exact_match"] > base["exact_match"] + 0.2
    assert merged["exact_match"] == trained["exact_match"]
    assert json.loads((run / "export" / "merge_check.json").read_text())["ok"]
    assert (run / "export" / "serve.sh").is_file() and (run / "eval" / "loss_curves.png").is_file()
