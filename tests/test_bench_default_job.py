"""scripts/bench_default_job.py: what it reports of a run besides the times (the job itself is minutes long:
run by hand, not here)."""

from __future__ import annotations

import json

from helpers import script_module


def test_metrics_lines_are_the_scores_eval_metrics_json_holds(tmp_path):
    bench = script_module("bench_default_job")
    (tmp_path / "eval").mkdir()
    doc = {
        "base": {"loss": 6.94339, "exact_match": 0.0, "generated": 256, "regression_checks_passed": None},
        "trained": {"loss": 0.21088, "exact_match": 0.78125, "generated": 256},
        "regression": {"trained": {"lost_checks": []}},
        "settings": {"num_samples": 256},
    }
    (tmp_path / "eval" / "metrics.json").write_text(json.dumps(doc))
    assert bench._metrics(tmp_path) == [
        "base     loss 6.9434, exact_match 0.0000, generated 256",
        "trained  loss 0.2109, exact_match 0.7812, generated 256",
    ]
    assert bench._metrics(tmp_path / "nothing") == []
