"""Evaluation: metrics, regression flags, loss curves, generation, and the eval/ contract (base, trained, merged)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import fast_eval, make_adapter_run, plan_for, tiny_cfg, write_log_history

from finetune.core import metrics, tasks
from finetune.core.config.evaluation import EvalConfig
from finetune.core.errors import ConfigError, DataError
from finetune.evaluation import curves, regression


def answer_length(prompts, predictions, references):
    """A user metric named by dotted path (tests.test_eval.answer_length)."""
    return sum(len(p) for p in predictions) / len(predictions)


# ---------------------------------------------------------------- metrics


def test_builtin_regex_and_user_metrics():
    prompts = ["Even or odd: 12", "Last digit of 47", "Opposite of hot:"]
    predictions = ["Even.", "the answer is 7", "cold"]
    references = ["even", "7", "cold"]
    fns = metrics.resolve(
        ["exact_match", "contains", r"regex:answer is (\d+)", "tests.test_eval.answer_length"]
    )
    scores = metrics.score(fns, prompts, predictions, references)
    assert scores["exact_match"] == pytest.approx(2 / 3)
    # exact_match is the bundled task's metric, with its per-task breakdown.
    assert {k: v for k, v in scores.items() if k.startswith("exact_match")} == tasks.score(
        prompts, predictions, references
    )
    assert scores["contains"] == 1.0
    assert scores["regex_match"] == pytest.approx(1 / 3)
    assert scores["answer_length"] == pytest.approx((5 + 15 + 4) / 3)
    two = metrics.score(metrics.resolve([r"regex:(\d)", r"regex:\w+"]), prompts, predictions, references)
    assert set(two) == {"regex_match_0", "regex_match_1"}


def test_metric_names_fail_early_and_clearly():
    with pytest.raises(ConfigError, match="not exact_match, contains"):
        EvalConfig(metrics=["bleu"])
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        EvalConfig(metrics=["regex:("])
    with pytest.raises(ConfigError, match="cannot import 'nowhere.fn'"):
        metrics.resolve(["nowhere.fn"])
    with pytest.raises(ConfigError, match="eval.metrics is empty"):
        EvalConfig(metrics=[])
    with pytest.raises(ConfigError, match="eval.top_p"):
        EvalConfig(top_p=0)


def test_eval_yaml_matches_the_schema():
    import yaml

    from finetune.core.composition import package_dir

    raw = yaml.safe_load((package_dir("configs") / "eval" / "default.yaml").read_text())
    defaults = dict(EvalConfig().__dict__)
    assert raw == {k: v for k, v in defaults.items() if k != "refusal_pattern"}


# ---------------------------------------------------------------- regression set


def test_bundled_regression_set_covers_its_kinds():
    rows = regression.load()
    kinds = {r["category"] for r in rows}
    assert kinds == {"facts", "arithmetic", "format", "language", "no_refusal"} and len(rows) >= 15
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(r["messages"][-1]["role"] == "user" for r in rows)


def test_regression_flags_and_new_regressions(tmp_path):
    pattern = EvalConfig().refusal_pattern
    assert regression.flags("I'm sorry, but I can't help with that.", None, pattern) == ["refusal"]
    assert regression.flags("I cannot do that", None, pattern) == ["refusal"]
    assert regression.flags("Use `kill -9 PID`; I can't stress enough...", None, pattern) == []
    assert regression.flags("  ", r"^\w+$", pattern) == ["empty", "check_failed"]
    assert regression.flags("YES", r"(?i)^yes$", pattern) == []

    rows = [
        {"id": "a", "check": None, "flags": {"base": [], "trained": ["refusal"]}},
        {"id": "b", "check": "x", "flags": {"base": [], "trained": ["empty", "check_failed"]}},
        {"id": "c", "check": "x", "flags": {"base": ["check_failed"], "trained": ["check_failed"]}},
    ]
    assert regression.regressions(rows, "trained") == {
        "new_refusals": ["a"],
        "new_empty": ["b"],
        "lost_checks": ["b"],
    }
    assert regression.summary(rows, "trained") == {
        "regression_refusals": 1, "regression_empty": 1, "regression_checks_passed": 0.0,
        "regression_checks_kept": 0.0,
    }  # fmt: skip
    # kept: of the checks the base passes (b; c it fails), the share the fine-tune passes too
    rows[1]["flags"]["trained"] = []
    assert regression.summary(rows, "trained")["regression_checks_kept"] == 1.0
    assert "regression_checks_kept" not in regression.summary(rows, "base")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    )
    with pytest.raises(DataError, match="bad.jsonl:1: 'messages' must end with the turn to answer"):
        regression.load(str(bad))


# ---------------------------------------------------------------- loss curves


def test_loss_history_merges_checkpoint_state_and_train_log(tmp_path):
    write_log_history(tmp_path, steps=20)
    (tmp_path / "checkpoints" / "checkpoint-5").mkdir()
    (tmp_path / "checkpoints" / "checkpoint-5" / "trainer_state.json").write_text('{"log_history": []}')
    log = [{"step": 21, "loss": 0.5}, {"step": 22, "eval_loss": 0.6}, {"step": 20, "loss": 0.9}]
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log) + '{"step": 23, "lo')
    series = curves.loss_series(curves.log_history(tmp_path))
    assert [s for s, _ in series["train"]] == list(range(1, 22))  # checkpoint-20 (not -5), then the log
    assert dict(series["train"])[20] == 0.9  # the log's entry wins for a step both have
    assert [s for s, _ in series["eval"]] == [5, 10, 15, 20, 22]

    out = tmp_path / "eval" / "loss_curves.png"
    assert curves.plot(tmp_path, out, {"base held-out loss": 3.0}) == {"train": 21, "eval": 5}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert curves.plot(tmp_path / "empty", tmp_path / "none.png") is None


# ---------------------------------------------------------------- generation


def test_batched_left_padded_generation_equals_one_by_one(tiny_cache, tiny_model_cfg, tiny_tokenizer):
    from finetune.evaluation.generate import generate
    from finetune.modeling import tiny

    model = tiny.load_model(tiny_model_cfg)
    prompts = [
        [{"role": "user", "content": c}]
        for c in ("Even or odd: 5", "Opposite of hot:", "Last digit of 123456")
    ]
    prompts.append([{"role": "system", "content": "Reply with the answer only."}, *prompts[0]])
    batched = generate(model, tiny_tokenizer, prompts, fast_eval(batch_size=4))
    alone = [generate(model, tiny_tokenizer, [p], fast_eval(batch_size=1))[0] for p in prompts]
    assert batched == alone and tiny_tokenizer.padding_side == "right"

    sampled = fast_eval(greedy=False, temperature=1.5, seed=3)
    first = generate(model, tiny_tokenizer, prompts, sampled)
    assert generate(model, tiny_tokenizer, prompts, sampled) == first  # the seed is reset per model


# ---------------------------------------------------------------- the stage and its contract


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_cache, tiny_data):
    """A LoRA run (random adapter) evaluated, then exported (which evaluates the merged model)."""
    from finetune.evaluation import stage as eval_stage
    from finetune.export import stage as export_stage

    run = tmp_path_factory.mktemp("eval") / "run"
    cfg = replace(
        tiny_cfg(run_dir=run), eval=fast_eval(metrics=["exact_match", "contains"], report_examples=3)
    )
    make_adapter_run(run, cfg.model, cfg.method)
    held_out = tiny_data[1].select(range(24))
    before = eval_stage.run(cfg, run, eval_dataset=held_out)
    after = export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)["eval"]
    return run, before, after


def test_metrics_json_contract(evaluated):
    run, before, after = evaluated
    assert set(before) == {"base", "trained", "regression", "settings", "models"}
    doc = json.loads((run / "eval" / "metrics.json").read_text())
    assert doc == after and {"base", "trained", "merged"} <= set(doc)
    # Which model each variant is: the merged one was made from the adapter scored as trained.
    assert (
        set(doc["models"]) == {"base", "trained", "merged"}
        and doc["models"]["trained"]["folder"] == "adapter"
    )
    assert doc["models"]["merged"]["made_from"]["sha256"] == doc["models"]["trained"]["sha256"]
    for v in ("base", "trained", "merged"):
        for key in ("loss", "exact_match", "contains", "regression_refusals", "regression_empty"):
            assert isinstance(doc[v][key], (int, float)), (v, key)
        assert doc[v]["generated"] == 6
    assert doc["base"] == before["base"] and doc["trained"] == before["trained"]  # kept, not redone
    assert doc["trained"]["loss"] != pytest.approx(
        doc["base"]["loss"], abs=1e-3
    )  # the adapter changes the model
    assert doc["merged"]["loss"] == pytest.approx(
        doc["trained"]["loss"], abs=1e-4
    )  # what ships = what trained
    assert doc["merged"]["exact_match"] == doc["trained"]["exact_match"]
    assert set(doc["regression"]) == {"trained", "merged"}
    assert set(doc["regression"]["merged"]) == {"new_refusals", "new_empty", "lost_checks"}
    assert doc["settings"]["decoding"] == {"do_sample": False} and doc["settings"]["max_new_tokens"] == 6


def test_samples_report_and_curves(evaluated):
    run, _, _ = evaluated
    rows = [json.loads(line) for line in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    task = [r for r in rows if r["set"] == "task"]
    reg = [r for r in rows if r["set"] == "regression"]
    assert len(task) == 6 and len(reg) == len(regression.load())
    for r in task:
        assert r["prompt"] and r["reference"] and {"base", "trained", "merged"} <= set(r)
        assert r["trained"] == r["merged"]  # greedy decoding of equal logits
    assert all(set(r["flags"]) == {"base", "trained", "merged"} for r in reg)

    report = (run / "eval" / "report.md").read_text()
    assert "| metric | base | trained | merged | trained − base | merged − base |" in report
    assert "## Regression set" in report and "![training and eval loss](loss_curves.png)" in report
    assert (run / "eval" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_mode_eval_again_reevaluates_everything_present(evaluated, tiny_data):
    from finetune.evaluation import stage as eval_stage

    run, _, after = evaluated
    cfg = replace(tiny_cfg(run_dir=run), eval=fast_eval(regression=False))
    again = eval_stage.run(cfg, run, eval_dataset=tiny_data[1].select(range(24)))
    assert set(again) == {"base", "trained", "merged", "regression", "settings", "models"}
    assert again["regression"] == {}
    assert again["merged"]["loss"] == pytest.approx(after["merged"]["loss"], abs=1e-6)
    rows = [json.loads(line) for line in (Path(run) / "eval" / "samples.jsonl").read_text().splitlines()]
    assert {r["set"] for r in rows} == {"task"}


def test_qlora_run_is_evaluated_on_its_4bit_base(tmp_path, tiny_cache, tiny_data):
    """QLoRA: base and trained load as trained (NF4 base), the adapter changes the loss."""
    from finetune.evaluation import stage as eval_stage

    run = tmp_path / "run"
    cfg = replace(tiny_cfg("method=qlora", run_dir=run), eval=fast_eval(num_samples=2, regression=False))
    make_adapter_run(run, cfg.model, cfg.method)
    result = eval_stage.run(cfg, run, eval_dataset=tiny_data[1].select(range(8)))
    assert set(result) == {"base", "trained", "regression", "settings", "models"}
    assert 0 < result["base"]["loss"] != pytest.approx(result["trained"]["loss"], abs=1e-3)


def test_an_adapter_saved_under_wrapper_names_is_refused_not_scored_as_the_base(
    tmp_path, tiny_cache, tiny_model_cfg
):
    """FSDP's checkpoint wrapper renames layers; PEFT would only warn and leave the adapter unloaded."""
    from safetensors.torch import load_file, save_file

    from finetune.core.config import MethodConfig
    from finetune.core.errors import LaunchError
    from finetune.modeling import tiny
    from finetune.modeling.loading import attach_adapter

    adapter = make_adapter_run(tmp_path / "run", tiny_model_cfg, MethodConfig(lora_dropout=0.0))
    attach_adapter(tiny.load_model(tiny_model_cfg), adapter)  # as saved: loads
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    renamed = {k.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): v for k, v in tensors.items()}
    save_file(renamed, str(path))
    moved = sum(k not in tensors for k in renamed)
    with (
        pytest.warns(UserWarning, match="missing adapter keys"),
        pytest.raises(LaunchError, match=rf"{moved} of {len(renamed)} adapter tensors match no module"),
    ):
        attach_adapter(tiny.load_model(tiny_model_cfg), adapter)


def test_no_held_out_split_means_no_loss_not_nan(tiny_cache, tiny_model_cfg, tiny_tokenizer, tiny_data):
    """data.eval_fraction=0: the held-out loss is absent (metrics.json stays strict JSON), not NaN."""
    from finetune.evaluation.heldout import heldout_loss
    from finetune.evaluation.stage import evaluate_model
    from finetune.modeling import tiny

    model = tiny.load_model(tiny_model_cfg)
    _, evals = tiny_data
    empty = evals.select([])
    assert heldout_loss(model, empty, tiny_tokenizer.pad_token_id) is None
    result, _, _ = evaluate_model(model, tiny_tokenizer, empty, [], [], fast_eval(num_samples=0), [], "base")
    assert "loss" not in result
    json.dumps(result, allow_nan=False)  # no NaN anywhere
    some = heldout_loss(model, evals.select(range(4)), tiny_tokenizer.pad_token_id)
    assert some is not None and 6.0 < some < 8.0  # random init on a 512-token vocabulary: about ln(512) = 6.2


# ---------------------------------------------------------------- what a reader sees: lost checks, counts


def _lost_two(run: Path) -> dict:
    """eval/metrics.json of a trained model that kept 3 of the base's 5 checks (lost fmt-2 and lang-4)."""
    result = {
        "base": {"loss": 2.0, "generated": 256, "regression_refusals": 0, "regression_checks_passed": 0.5},
        "trained": {
            "loss": 1.5,
            "generated": 256,
            "regression_refusals": 1,
            "regression_checks_passed": 0.4,
            "regression_checks_kept": 0.6,
        },
        "regression": {
            "trained": {"new_refusals": ["gen-1"], "new_empty": [], "lost_checks": ["fmt-2", "lang-4"]}
        },
        "settings": {},
        "models": {},
    }
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "metrics.json").write_text(json.dumps(result))
    return result


def test_lost_regression_checks_are_marked_and_warned_in_report_and_console(tmp_path, capsys):
    from finetune.evaluation import stage as eval_stage
    from finetune.evaluation.report import write_report

    result = _lost_two(tmp_path)
    write_report(tiny_cfg(), tmp_path / "report.md", result, [], curves_drawn=False)
    report = (tmp_path / "report.md").read_text().splitlines()
    # gains ✓, losses ✗; counts as integers; the kept share marked where checks were lost
    assert "| loss | 2.0000 | 1.5000 | -0.5000 ✓ |" in report
    assert "| regression_refusals | 0 | 1 | +1 ✗ |" in report
    assert "| regression_checks_kept | - | 0.6000 ✗ | - |" in report
    assert "| generated | 256 | 256 | +0 |" in report
    warning = (
        "**Warning**: trained fails 2 regression checks the base passes (fmt-2, lang-4); its answers are in "
        "eval/report.md and eval/samples.jsonl."
    )
    assert warning in report
    assert "- **trained**: new refusals: gen-1; lost checks: fmt-2, lang-4" in report

    eval_stage.show(tmp_path)
    err = " ".join(capsys.readouterr().err.split())
    assert "regression_checks_kept │ - │ 0.6000 ✗" in err and "generated │ 256 │ 256" in err
    assert "256.0000" not in err
    assert err.count("warning: trained fails 2 regression checks the base passes (fmt-2, lang-4)") == 1


def test_no_evaluation_shows_nothing(tmp_path, capsys):
    from finetune.evaluation import stage as eval_stage

    eval_stage.show(tmp_path)
    assert capsys.readouterr() == ("", "")
