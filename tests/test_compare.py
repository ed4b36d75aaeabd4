"""mode=compare: runs side by side; the knobs that differ, training summaries, every metric, the best marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune import rundir
from finetune.core.errors import ConfigError
from finetune.pipeline import compare
from finetune.pipeline.cli import compose


def _fake_run(root: Path, name: str, lr: str, trained_loss: float, em: float, eval_file: bool = True) -> Path:
    """A finished run's folder as compare reads it (config.yaml, metrics.json, eval/metrics.json), not trained."""
    run = root / name
    cfg = compose([f"run_dir={run}", f"method.learning_rate={lr}"])
    run.mkdir(parents=True)
    rundir.save_config(cfg, run)
    variants = {
        "base": {"loss": 6.8, "exact_match": 0.0, "generated": 6},
        "trained": {"loss": trained_loss, "exact_match": em, "generated": 6},
    }
    if eval_file:
        variants["merged"] = dict(variants["trained"])
        rundir.write_json(run / "eval" / "metrics.json", {**variants, "regression": {}, "settings": {}})
    train = {"steps": 250, "final_loss": trained_loss - 0.1, "tokens_per_second": 900.0}
    rundir.write_json(run / "metrics.json", {"train": train, "eval": variants})
    return run


def test_compare_table_printed_and_written(tmp_path):
    from rich.console import Console

    a = _fake_run(tmp_path, "lr1e-3", "1e-3", 1.2, 0.5)
    b = _fake_run(tmp_path, "lr5e-3", "5e-3", 0.9, 0.8)
    c = _fake_run(tmp_path, "lr1e-2", "1e-2", 2.5, 0.1, eval_file=False)  # only training's metrics.json
    console = Console(record=True, width=200)
    table = compare.run([str(a), str(b), str(c)], tmp_path / "out", console=console)

    assert [r["name"] for r in table["runs"]] == ["lr1e-3", "lr5e-3", "lr1e-2"]
    assert [r["source"] for r in table["runs"]] == ["eval/metrics.json", "eval/metrics.json", "metrics.json"]
    rows = {r["key"]: r for r in table["rows"]}
    assert rows["method.learning_rate"]["values"] == [
        1e-3,
        5e-3,
        1e-2,
    ]  # the sweep's knob, found by diffing configs
    assert "run_dir" not in rows and "model.hidden_size" not in rows  # equal or ignored keys are left out
    assert rows["trained.loss"]["values"] == [1.2, 0.9, 2.5] and rows["trained.loss"]["best"] == 1
    assert rows["trained.exact_match"]["best"] == 1 and rows["train.final_loss"]["best"] == 1
    assert rows["merged.loss"]["values"] == [1.2, 0.9, None]
    assert rows["base.loss"]["best"] is None  # all equal: nothing to mark
    assert "trained.generated" not in rows

    text = console.export_text()
    assert "runs compared" in text and "method.learning_rate" in text and "lr5e-3" in text
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "| | lr1e-3 | lr5e-3 | lr1e-2 |" in md and "| trained.loss | 1.2 | **0.9** | 2.5 |" in md
    assert json.loads((tmp_path / "out" / "compare.json").read_text()) == json.loads(json.dumps(table))


def test_runs_resolve_by_name_under_runs(tmp_path, monkeypatch):
    _fake_run(tmp_path / "runs", "a", "1e-3", 1.0, 0.5)
    monkeypatch.chdir(tmp_path)
    assert compare.resolve_run("a") == Path("runs") / "a"
    with pytest.raises(ConfigError, match="runs: 'nope' is not a run directory"):
        compare.resolve_run("nope")
    with pytest.raises(ConfigError, match="name at least one run"):
        compare.collect([])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="none of these runs has metrics"):
        compare.collect([tmp_path / "empty"])
