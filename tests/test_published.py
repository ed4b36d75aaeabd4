"""The plan against other projects' published measurements (scripts/published_runs.json, BENCHMARKS.md's
"Published measurements"): every row plans what the table says, and the comparable rows meet the target."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import script_module

PUBLISHED = script_module("published")
ROWS = PUBLISHED.load()["rows"]


def test_at_least_ten_sourced_rows_of_other_projects():
    assert len(ROWS) >= 10 and len({r["id"] for r in ROWS}) == len(ROWS)
    assert len({r["project"] for r in ROWS}) >= 4
    for r in ROWS:
        assert r["source"].startswith("https://") and r["commit"] in r["source"], r["id"]
        assert r["date"][:4] in ("2024", "2025", "2026") and r["ran"], r["id"]
        assert r["measured"]["kind"] in PUBLISHED.KINDS and r["measured"]["unit"] in ("GB", "GiB"), r["id"]
        assert r["measured"]["how"] and isinstance(r["planner_gb"], float), r["id"]
        # every strategy setting fixed: the row plans the published run, not what the search would pick
        keys = {o.split("=")[0] for o in r["overrides"]}
        for key in (
            "train.sharding",
            "train.activation_checkpointing",
            "train.micro_batch_size",
            "method.optimizer",
        ):
            assert key in keys, (r["id"], key)


@pytest.fixture(scope="module")
def planned() -> list[dict[str, Any]]:
    return [PUBLISHED.plan_row(r) for r in ROWS]


def test_every_row_plans_what_the_table_says(planned):
    for r, p in zip(ROWS, planned):
        assert p["figure"] == pytest.approx(r["planner_gb"], rel=0.005, abs=0.005), r["id"]


def test_comparable_rows_meet_the_target_and_the_others_name_what_differs(planned):
    comparable = [(r, p) for r, p in zip(ROWS, planned) if not r["unmodeled"]]
    assert len(comparable) >= 3
    for r, p in comparable:
        err = PUBLISHED.error(r, p["figure"])
        assert -0.10 <= err <= 0.20, (r["id"], err)
    for r in ROWS:
        assert r["unmodeled"] is None or len(r["unmodeled"]) > 40, r["id"]


def test_the_figure_is_the_measured_kind(planned):
    """allocated/active: the plan's tensors; reserved: the total less the CUDA context; device: the total."""
    by_kind = {r["measured"]["kind"]: p for r, p in zip(ROWS, planned)}
    cuda_context = 0.8  # calibration.json's cuda.fixed_gb
    assert by_kind["device"]["figure"] == by_kind["device"]["total"]
    assert by_kind["reserved"]["figure"] == pytest.approx(by_kind["reserved"]["total"] - cuda_context)
    assert by_kind["allocated"]["figure"] < by_kind["allocated"]["total"] - cuda_context


def test_the_table_prints_every_row(planned):
    text = PUBLISHED.table(ROWS, planned)
    assert all(f"`{r['id']}`" in text for r in ROWS)
    assert "target (within +20%, never more than 10% below): met" in text
    assert "torchtune#961" in text  # what the torchtune figures are, said in the row
