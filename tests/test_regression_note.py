"""A regression set the base passes none of measures nothing: evaluation says so in words, not as 0.0000.

    python -m pytest tests/test_regression_note.py

The embedded default (`tiny`, random init) fails every check of the bundled regression set before and
after training; a report of `regression_checks_passed 0.0000` for base, trained and merged would read as
if that were a result.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers import fast_eval, make_adapter_run, tiny_cfg

from finetune.evaluation import regression
from finetune.pipeline import stages

NOTE_29 = "regression set: the base passes 0 of 29 checks, so it measures nothing for this model"


def _rows(base: list[list[str]], trained: list[list[str]]) -> list[dict]:
    return [
        {"id": f"r{i}", "check": "x", "flags": {"base": b, "trained": t}}
        for i, (b, t) in enumerate(zip(base, trained))
    ] + [{"id": "no-check", "check": None, "flags": {"base": [], "trained": ["refusal"]}}]


def test_a_base_that_passes_no_check_gives_no_shares_and_says_why():
    failed = ["check_failed"]
    rows = _rows([failed, failed, failed], [failed, [], failed])
    note = "regression set: the base passes 0 of 3 checks, so it measures nothing for this model"
    assert regression.nothing_measured(3) == note
    assert regression.summary(rows, "base") == {
        "regression_refusals": 0, "regression_empty": 0, "regression_checks_passed": None,
        "regression_note": note,
    }  # fmt: skip
    # the trained model passing one of them says nothing either: a check the base fails measures no forgetting
    assert regression.summary(rows, "trained") == {
        "regression_refusals": 1, "regression_empty": 0, "regression_checks_passed": None,
        "regression_checks_kept": None, "regression_note": note,
    }  # fmt: skip
    assert regression.note({"base": {"loss": 1.0}, "trained": regression.summary(rows, "trained")}) == note


def test_a_base_that_passes_one_check_keeps_the_numbers_and_no_note():
    failed = ["check_failed"]
    rows = _rows([failed, [], failed], [failed, failed, []])
    assert regression.summary(rows, "base") == {
        "regression_refusals": 0, "regression_empty": 0, "regression_checks_passed": 0.3333,
    }  # fmt: skip
    assert regression.summary(rows, "trained") == {
        "regression_refusals": 1, "regression_empty": 0, "regression_checks_passed": 0.3333,
        "regression_checks_kept": 0.0,
    }  # fmt: skip
    # a model scored without the base's answers (none kept in samples.jsonl): nothing known about the base
    alone = [{"id": "r0", "check": "x", "flags": {"merged": ["check_failed"]}}]
    assert regression.summary(alone, "merged") == {
        "regression_refusals": 0, "regression_empty": 0, "regression_checks_passed": 0.0,
        "regression_checks_kept": None,
    }  # fmt: skip
    assert regression.note({"base": regression.summary(rows, "base")}) is None


@pytest.mark.slow  # the evaluation stage on the tiny model: 40 s of CPU, minutes on the loaded shared cores
def test_the_tiny_models_evaluation_says_the_regression_set_measures_nothing(
    tmp_path, tiny_cache, tiny_data, capsys
):
    """The real evaluation stage on the random-init tiny model and the bundled regression set (29 checks)."""
    from finetune.evaluation import stage as eval_stage

    run = tmp_path / "run"
    cfg = replace(tiny_cfg(run_dir=run), eval=fast_eval(num_samples=2, max_new_tokens=4))
    make_adapter_run(run, cfg.model, cfg.method)
    assert sum(1 for r in regression.load() if r["check"]) == 29
    eval_stage.run(cfg, run, eval_dataset=tiny_data[1].select(range(4)))

    doc = json.loads((run / "eval" / "metrics.json").read_text())
    for v in ("base", "trained"):
        assert doc[v]["regression_checks_passed"] is None and doc[v]["regression_note"] == NOTE_29
    assert doc["trained"]["regression_checks_kept"] is None
    # every check the base failed, the trained model failed too: nothing reported as lost
    assert doc["regression"]["trained"]["lost_checks"] == []

    report = (run / "eval" / "report.md").read_text().splitlines()
    assert "| regression_checks_passed | - | - | - |" in report
    assert f"{NOTE_29[0].upper()}{NOTE_29[1:]}." in report
    assert (
        "The base passes none of their checks, so a failed check below says nothing about forgetting."
        in report
    )
    # the table, printed once after the last stage: the sentence under it, no 0.0000 share, no lost checks
    capsys.readouterr()
    eval_stage.show(run)
    err = capsys.readouterr().err
    assert NOTE_29 in " ".join(err.split()) and "0.0000" not in err.split("regression_checks_passed")[1][:40]
    assert err.count(NOTE_29.split(",")[0]) == 1 and "warning" not in err and "✗" not in err

    # the pipeline's closing lines name where the evaluation is read, not its numbers again
    stages._print_summary(run, stages._stamps(run))
    out = capsys.readouterr().out.splitlines()
    shown = ", ".join(str(run / "eval" / n) for n in ("report.md", "loss_curves.png", "samples.jsonl"))
    assert out[-1] == f"evaluation: {shown}"
    assert not any("regression_checks_passed" in line or "loss" in line.split(":")[0] for line in out)
