"""eval.lm_eval_tasks: lm-evaluation-harness on base and trained, over a local task in the harness's YAML format
(the bundled chat data's parity questions as a JSONL), its scores and deltas in metrics.json and report.md."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import fast_eval, make_adapter_run, tiny_cfg

from finetune.core.config.evaluation import EvalConfig
from finetune.core.errors import ConfigError
from finetune.core.package import PACKAGE_DIR
from finetune.evaluation import lm_eval

TASK = "finetune_parity"


def parity_task(folder: Path, n: int = 12) -> Path:
    """A multiple-choice task (even or odd) over the first `n` parity questions of the bundled chat data, as
    a JSONL beside the harness's task YAML; the YAML's path."""
    rows = []
    for line in (PACKAGE_DIR / "data" / "bundled" / "chat.jsonl").read_text().splitlines():
        messages = json.loads(line)["messages"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        answer = messages[-1]["content"]
        if answer in ("even", "odd"):
            rows.append({"question": user, "label": ["even", "odd"].index(answer)})
        if len(rows) == n:
            break
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "parity.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml_path = folder / "parity.yaml"
    yaml_path.write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: [even, odd]\n"
        "doc_to_target: label\n"
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return yaml_path


def test_task_files_are_checked_before_any_model_loads(tmp_path):
    pytest.importorskip("lm_eval")
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_path: json\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: no `task:` name in it"):
        lm_eval.check(EvalConfig(lm_eval_tasks=[str(bad)]))
    with pytest.raises(ConfigError, match=r"eval.lm_eval_limit=0 must be > 0"):
        EvalConfig(lm_eval_tasks=["mmlu"], lm_eval_limit=0)


def test_deltas_are_against_the_base():
    result = {"base": {"loss": 2.0, "lm_eval/t/acc": 0.25}, "trained": {"loss": 1.0, "lm_eval/t/acc": 0.75},
              "merged": {"lm_eval/t/acc": 0.5}, "settings": {}}  # fmt: skip
    assert lm_eval.deltas(result) == {
        "lm_eval_deltas": {"trained": {"lm_eval/t/acc": 0.5}, "merged": {"lm_eval/t/acc": 0.25}}
    }
    assert lm_eval.deltas({"base": {"loss": 1.0}, "trained": {"loss": 0.5}}) == {}


@pytest.mark.slow
def test_harness_scores_base_and_trained_in_metrics_and_report(tmp_path, tiny_cache, tiny_data):
    """The evaluation stage with a local task: each model's accuracy is the harness's, recomputed here from
    the same model's log-likelihood of each choice after the chat-formatted question; the deltas in
    metrics.json are trained minus base, and report.md has the row."""
    pytest.importorskip("lm_eval")
    import torch

    from finetune.evaluation import stage as eval_stage
    from finetune.modeling.models import load_tokenizer
    from finetune.modeling.variants import load_variant

    task = parity_task(tmp_path / "task")
    run = tmp_path / "run"
    settings = dict(num_samples=2, regression=False, lm_eval_tasks=[str(task)])
    cfg = replace(tiny_cfg(run_dir=run), eval=fast_eval(**settings))
    make_adapter_run(run, cfg.model, cfg.method, b_std=0.5)
    result = eval_stage.run(cfg, run, eval_dataset=tiny_data[1].select(range(4)))

    key = f"lm_eval/{TASK}/acc"
    doc = json.loads((run / "eval" / "metrics.json").read_text())
    assert doc["lm_eval_deltas"] == {"trained": {key: pytest.approx(doc["trained"][key] - doc["base"][key])}}
    assert doc["base"][key] == result["base"][key]

    tokenizer = load_tokenizer(cfg.model)
    rows = [json.loads(line) for line in (task.parent / "parity.jsonl").read_text().splitlines()]
    for variant in ("base", "trained"):
        model = load_variant(cfg, run, variant).eval()
        right = 0
        for row in rows:
            context = tokenizer.apply_chat_template(
                [{"role": "user", "content": row["question"]}], tokenize=False, add_generation_prompt=True
            )
            scores = []
            for choice in ("even", "odd"):
                whole = tokenizer(context + choice, add_special_tokens=False)["input_ids"]
                start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
                with torch.no_grad():
                    logits = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
                scores.append(sum(logits[i - 1, whole[i]].item() for i in range(start, len(whole))))
            right += int(scores.index(max(scores)) == row["label"])
        assert doc[variant][key] == pytest.approx(right / len(rows)), variant

    report = (run / "eval" / "report.md").read_text()
    assert key in report
