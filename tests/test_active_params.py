"""Active parameters (those a token runs through) in plan.json and the plan table: a mixture of experts' routed
share, a dense model's total."""

from __future__ import annotations

import json

from helpers import planned
from rich.console import Console

from finetune.pipeline.plan_report import print_plan
from finetune.planner import Plan

# Mixtral-8x7B, per layer: attention (q, o 4096 x 4096; k, v 4096 x 1024), 2 of 8 experts (3 x 4096 x 14336),
# the router (4096 x 8) and two norms; then the embedding and the untied head (32000 x 4096) and the final norm
MIXTRAL_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096
MIXTRAL_ACTIVE = 32 * MIXTRAL_LAYER + 2 * 32000 * 4096 + 4096
# Qwen3-30B-A3B, per layer: attention (q, o 2048 x 4096; k, v 2048 x 512), 8 of 128 experts (3 x 2048 x 768),
# the router (2048 x 128), two norms and the q/k norms (128 each); the embedding and head are 151936 x 2048
QWEN3_LAYER = 2 * 2048 * 4096 + 2 * 2048 * 512 + 8 * 3 * 2048 * 768 + 2048 * 128 + 2 * 2048 + 2 * 128
QWEN3_ACTIVE = 48 * QWEN3_LAYER + 2 * 151936 * 2048 + 2048


def _params_line(plan: Plan) -> str:
    console = Console(record=True, width=300)
    print_plan(plan, title="job", console=console)
    return next(line for line in console.export_text().splitlines() if line.startswith("params:"))


def test_mixtral_active_parameters_are_its_published_12_9b():
    _, plan = planned("model=mixtral_8x7b", "method=lora", "hardware=h200")
    assert plan.params_active == MIXTRAL_ACTIVE == 12_879_925_248
    assert plan.params_total == 46_702_792_704
    assert plan.to_dict()["params"] == {
        "total": 46_702_792_704,
        "trainable": plan.params_trainable,
        "active": 12_879_925_248,
    }
    assert _params_line(plan).startswith("params: 46,702,792,704 total, 12,879,925,248 active, ")


def test_qwen3_30b_a3b_active_parameters_are_its_published_3_3b():
    _, plan = planned("model=qwen3_30b_a3b", "method=lora", "hardware=h100")
    assert plan.params_active == QWEN3_ACTIVE == 3_353_032_704
    assert plan.to_dict()["params"]["active"] == 3_353_032_704
    assert "3,353,032,704 active" in _params_line(plan)


def test_a_dense_model_s_active_parameters_are_its_total(tmp_path):
    _, plan = planned("model=llama3_1_8b", "method=lora", "hardware=h100")
    assert plan.params_active == plan.params_total == 8_030_261_248
    # the table names active parameters only where they differ from the total
    assert _params_line(plan).startswith("params: 8,030,261,248 total, 41,943,040 trainable")
    # plan.json carries them, and a worker reads them back
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    back = Plan.from_dict(json.loads(path.read_text()))
    assert (back.params_total, back.params_active) == (8_030_261_248, 8_030_261_248)
