"""The embedded default end to end (slow): data -> plan -> train -> eval -> export -> serve.sh,
with the fine-tuned and merged models beating the base on the bundled task; a finished job run again."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import SHORT_RUN, child_env, run_cli, tiny_cfg, write_engine


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


@pytest.mark.slow
def test_a_finished_job_run_again_says_so_and_redoes_only_what_is_asked(tmp_path, tiny_cache):
    """`python -m finetune` twice: the second run trains, scores and exports nothing, says so with the
    redo= to pass, and prints the evaluation table once; redo=eval scores again (the same numbers), and
    leaves the export as it was."""
    run = tmp_path / "run"
    args = [
        f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", *SHORT_RUN, "train.max_steps=4",
        "eval.num_samples=4", "eval.max_new_tokens=4", "eval.regression=false", "eval.progress=false",
    ]  # fmt: skip
    env = child_env(FINETUNE_CACHE=str(tiny_cache))

    def cli(*extra: str):
        done = run_cli(*args, *extra, env=env, timeout=900)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        return done

    def stamp(path):
        st = path.stat()
        return st.st_ino, st.st_mtime_ns

    first = cli()
    assert first.stderr.count("evaluation") >= 1 and first.stderr.count("┃ metric") == 1  # the table once
    scored = json.loads((run / "eval" / "metrics.json").read_text())
    assert {"base", "trained", "merged"} <= set(scored)
    # metrics.json carries the eval stage's scores beside training's
    run_metrics = json.loads((run / "metrics.json").read_text())
    assert run_metrics["eval"] == {v: scored[v] for v in ("base", "trained", "merged")}
    assert run_metrics["train"]["steps"] == 4
    kept = {p: stamp(run / p) for p in ("adapter", "eval/metrics.json", "export/merged", "metrics.json")}

    again = cli()
    assert "training: finished already (4 steps, adapter/); redo=train does it again" in again.stdout
    assert (
        f"evaluation: finished already (base, trained, merged scored: {run / 'eval' / 'metrics.json'}); "
        "redo=eval scores them again"
    ) in again.stdout
    assert "export: finished already (export/ made from adapter/ of step 4" in again.stdout
    assert "redo=export does it again" in again.stdout
    assert {p: stamp(run / p) for p in kept} == kept  # nothing rewritten
    assert again.stderr.count("┃ metric") == 1 and "launch:" not in again.stdout  # no rank started
    assert again.stdout.splitlines()[-1].startswith(f"evaluation: {run / 'eval' / 'report.md'}")

    redone = cli("redo=eval")
    assert stamp(run / "eval/metrics.json") != kept["eval/metrics.json"]
    assert (
        stamp(run / "export/merged") == kept["export/merged"] and "export: finished already" in redone.stdout
    )
    rescored = json.loads((run / "eval" / "metrics.json").read_text())
    for v in ("base", "trained", "merged"):
        assert rescored[v]["loss"] == pytest.approx(scored[v]["loss"], abs=1e-6)


def test_training_is_finished_for_the_output_on_disk_and_the_length_asked_only(tmp_path):
    from finetune.modeling import outputs
    from finetune.pipeline import stages

    cfg = tiny_cfg("train.max_steps=4", run_dir=tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"step 4")
    identity = outputs.record(adapter, 4, "run1", "adapter")
    train = {"steps": 4, "output_identity": identity.to_dict(), "schedule": cfg.train.length()}
    (tmp_path / "metrics.json").write_text(json.dumps({"train": train}))
    assert stages.finished_training(cfg, tmp_path) == "4 steps, adapter/"
    # a longer run asked for (train.max_steps=6, or epochs instead of steps): training to do
    assert stages.finished_training(tiny_cfg("train.max_steps=6", run_dir=tmp_path), tmp_path) is None
    assert stages.finished_training(tiny_cfg("train.max_steps=-1", run_dir=tmp_path), tmp_path) is None
    # another output on disk than the one metrics.json names (saved by hand, or by a later run)
    (adapter / "adapter_model.safetensors").write_bytes(b"other")
    outputs.record(adapter, 4, "run2", "adapter")
    assert stages.finished_training(cfg, tmp_path) is None
    # no export made from the adapter on disk: export is not finished
    assert stages.finished_export(cfg, tmp_path) is None
