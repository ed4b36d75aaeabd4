"""The eval stage: the one place base, trained and merged models are scored, each once, on the same prompts.

    python -m finetune +recipe=tiny mode=eval       # after mode=train; export scores `merged` through it
    python -m finetune +recipe=tiny redo=eval       # score every model again

For each model: the held-out loss over the data stage's eval split, task
metrics on generated answers to its prompts (`eval.metrics`), the objective's own
rewards on those answers where it has them (GRPO: `mean_reward`, `pass_rate`), and the
regression set's answers with their flags. Writes into RUN_DIR/eval/:

- metrics.json  {base: {loss, <metrics>...}, trained: {...}, merged: {...},
                 regression: {trained: {new_refusals, new_empty, lost_checks}, ...}, settings: {...},
                 models: {base: {source}, trained: <identity>, merged: {path, made_from: <identity>}},
                 skipped: {merged: why}}
- samples.jsonl one row per prompt: id, set, prompt, reference, base, trained[, merged]
- report.md     which model each column is, the table, regressions, examples, the loss curves
- loss_curves.png  training and eval loss from the trainer's log history
- made_from.json   the trained output evaluated (`finetune.modeling.outputs`)

Provenance: `merged` is scored only when export/ was made from the trained output scored as `trained`
(its identity); an export made from another model is skipped with a one-line note (and named in
`skipped`). A model already scored with the same settings is kept, not scored again (`redo=eval` asks
for it). The folder is written into RUN_DIR/.eval.tmp and renamed into place whole (report.md always
matches metrics.json); the scores also go into RUN_DIR/metrics.json's `eval`. The table is printed by
`show`, once, after the last stage of a command.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core import metrics
from finetune.core.config import Config
from finetune.core.config.evaluation import EvalConfig
from finetune.core.markup import console_text, terminal_text
from finetune.data.stage import load_prepared
from finetune.evaluation import curves, lm_eval, regression
from finetune.evaluation.generate import generate, sampling_kwargs
from finetune.evaluation.heldout import answered, heldout_loss, vision_heldout_loss
from finetune.evaluation.report import metric_names, write_report
from finetune.modeling import outputs, vision
from finetune.modeling.loading import attach_adapter, initial_output
from finetune.modeling.models import load_tokenizer
from finetune.modeling.variants import (
    VARIANTS,
    adapter_on_unchanged_base,
    available_variants,
    base_source,
    load_variant,
    trained_dir,
)

log = logging.getLogger(__name__)


def task_items(eval_ds: Any, num_samples: Optional[int]) -> list[dict]:
    """The held-out conversations to answer: id, the conversation up to the answer, prompt text, reference."""
    if "messages" not in eval_ds.column_names:
        return []
    n = len(eval_ds) if num_samples is None else min(num_samples, len(eval_ds))
    items = []
    images = (
        "images" in eval_ds.column_names
    )  # a vision-language model's rows: the pictures go with the prompt
    for i, conversation, reference in answered(eval_ds, n):
        if images:
            conversation = vision.with_images(conversation, eval_ds[i]["images"])
        prompt = vision.prompt_text(conversation)
        items.append({"id": f"task-{i}", "messages": conversation, "prompt": prompt, "reference": reference})
    return items


def evaluate_model(
    model: Any,
    tokenizer: Any,
    eval_ds: Any,
    items: Sequence[dict],
    reg_rows: Sequence[dict],
    cfg: EvalConfig,
    metric_fns: Sequence[metrics.Metric],
    label: str,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """(metrics, task answers, regression answers) for one model."""
    model.eval()
    if "images" in eval_ds.column_names:  # a vision-language model's rows: through its processor
        loss = vision_heldout_loss(model, eval_ds, tokenizer, cfg.batch_size)
    else:
        loss = heldout_loss(model, eval_ds, tokenizer.pad_token_id, cfg.batch_size)
    result: dict[str, Any] = {} if loss is None else {"loss": loss}  # None: no held-out split
    answers = generate(model, tokenizer, [it["messages"] for it in items], cfg, f"{label}: held-out prompts")
    if items:
        result.update(
            metrics.score(
                metric_fns, [it["prompt"] for it in items], answers, [it["reference"] for it in items]
            )
        )
    result["generated"] = len(items)
    reg_answers = generate(
        model, tokenizer, [r["messages"] for r in reg_rows], cfg, f"{label}: regression set"
    )
    return result, answers, reg_answers


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_samples(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["id"]: r for r in rows}


def _sample_rows(
    items: Sequence[dict], reg_rows: Sequence[dict], old: dict[str, dict], keep: Sequence[str]
) -> list[dict]:
    """Fresh rows for this evaluation, keeping the answers of the models in `keep` where the prompt is unchanged."""
    rows = []
    for it in items:
        rows.append({"id": it["id"], "set": "task", "prompt": it["prompt"], "reference": it["reference"]})
    for r in reg_rows:
        prompt = next((m["content"] for m in reversed(r["messages"]) if m["role"] == "user"), "")
        rows.append(
            {
                "id": r["id"],
                "set": "regression",
                "category": r["category"],
                "prompt": prompt,
                "reference": None,
                "check": r["check"],
                "flags": {},
            }
        )
    for row in rows:
        prev = old.get(row["id"])
        if prev and prev.get("prompt") == row["prompt"] and prev.get("reference") == row["reference"]:
            for v in keep:
                if v in prev:
                    row[v] = prev[v]
            if "flags" in row:
                row["flags"] = {v: f for v, f in (prev.get("flags") or {}).items() if v in keep}
    return rows


def settings(cfg: Config) -> dict[str, Any]:
    e = cfg.eval
    return {
        "metrics": list(e.metrics),
        "num_samples": e.num_samples,
        "max_new_tokens": e.max_new_tokens,
        "batch_size": e.batch_size,
        "decoding": {k: v for k, v in sampling_kwargs(e).items() if v is not None},
        "seed": e.seed,
        "regression_prompts": (e.regression_prompts or "bundled") if e.regression else None,
        "chat_template": "the tokenizer's (same for every model)",
    }


@dataclass
class _Models:
    """What each variant is: the base's source, the trained output's identity, what the export was made from."""

    records: dict[str, dict]  # metrics.json `models`, for the variants present
    trained: Optional[outputs.Identity]
    skipped: dict[str, str]  # variant -> why it is not scored


def _models(cfg: Config, run_dir: Path, present: Sequence[str]) -> _Models:
    trained = outputs.identity_of(trained_dir(cfg, run_dir)) if "trained" in present else None
    start_adapter = initial_output(cfg)[0]
    base = {"model": cfg.model.name, "source": base_source(cfg)}
    if start_adapter is not None:  # the base scored is init_from's adapter on the base (models.load_start)
        base["adapter"] = str(start_adapter.resolve())
    records: dict[str, dict] = {"base": base}
    if trained is not None:
        records["trained"] = trained.to_dict()
    skipped = {}
    if "merged" in present:
        source = outputs.made_from(rundir.export_dir(run_dir))
        records["merged"] = {
            "path": f"{rundir.EXPORT_DIR}/{rundir.MERGED_DIR}",
            "made_from": source.to_dict() if source else None,
        }
        if not outputs.same_model(source, trained):
            skipped["merged"] = _stale_export(source, trained)
    return _Models(records, trained, skipped)


def _stale_export(source: Optional[outputs.Identity], trained: Optional[outputs.Identity]) -> str:
    where = f"{rundir.EXPORT_DIR}/{rundir.MERGED_DIR}"
    if source is None:
        return f"{where} records no trained model it was made from (exported by an older finetune)"
    if trained is None:
        return (
            f"{where} was made from {source.describe()}, and there is no trained output to check it against"
        )
    return f"{where} was made from {source.describe()}, not from the trained {trained.describe()}"


def _key(variant: str, record: Any) -> Any:
    """What makes two evaluations of `variant` the same model: the base's source, the trained output's
    hash, the hash of the output the export was made from."""
    if not isinstance(record, dict):
        return None
    if variant == "base":
        return (record.get("source"), record.get("adapter"))
    if variant == "trained":
        return record.get("sha256")
    return (record.get("made_from") or {}).get("sha256")


def _kept(old_metrics: dict[str, Any], models: _Models, todo: Sequence[str], settings_now: dict) -> list[str]:
    """The variants of an earlier evaluation to keep: scored with these settings and recorded as the same model
    as the one present now (nothing is kept from a file that records no models), and not asked for again."""
    if old_metrics.get("settings") != settings_now:
        return []
    old_models = old_metrics.get("models") or {}
    kept = []
    for v in VARIANTS:
        if v not in old_metrics or v in todo or v not in models.records or v in models.skipped:
            continue
        then, now = _key(v, old_models.get(v)), _key(v, models.records[v])
        if then is not None and then == now:
            kept.append(v)
    return kept


@dataclass
class _Prompts:
    """What every model answers: the held-out task items and the regression set, with the rows of
    samples.jsonl their answers go into."""

    items: list[dict]
    reg_rows: list[dict]
    rows: list[dict]


def run(
    cfg: Config,
    run_dir: Path,
    variants: Optional[Sequence[str]] = None,
    *,
    eval_dataset: Any = None,
    redo: bool = False,
) -> dict[str, Any]:
    """Score `variants` (None: every model the run directory holds) and write RUN_DIR/eval/; returns its
    metrics.json content.

    A model already scored with the same settings (the same base, trained output or export) is kept as it
    was, not scored again, unless `redo`; with nothing left to score nothing is written. The scores also go
    into RUN_DIR/metrics.json's `eval`. `eval_dataset` replaces the data stage's eval split (tests).
    """
    run_dir = Path(run_dir)
    metric_fns = metrics.resolve(
        cfg.eval.metrics, cfg.eval.metric_timeout_s
    )  # a bad dotted path fails before any model loads
    lm_eval.check(cfg.eval)
    # A model that does not generate (a score head: a reward model) is scored by its objective's scores alone.
    generates = cfg.objective.spec.generates_text
    reg_rows = regression.load(cfg.eval.regression_prompts) if cfg.eval.regression and generates else []
    asked = _variants_to_evaluate(cfg, run_dir, variants)
    models = _models(cfg, run_dir, available_variants(cfg, run_dir))
    for v, why in models.skipped.items():
        if v in asked:
            asked.remove(v)
            log.warning("eval: %s: not scored as %r; run mode=export to export this trained model", why, v)
    out_dir = rundir.eval_dir(run_dir)
    old_metrics = _read_json(out_dir / rundir.EVAL_METRICS_FILE)
    done = [] if redo else _kept(old_metrics, models, (), settings(cfg))
    todo = [v for v in asked if v not in done]
    if not todo:
        if asked:
            print(
                f"evaluation: finished already ({', '.join(asked)} scored: "
                f"{terminal_text(out_dir / rundir.EVAL_METRICS_FILE)}); redo=eval scores them again"
            )
        return old_metrics
    keep = [v for v in done if v not in todo]
    if eval_dataset is None:
        eval_dataset = load_prepared(run_dir)[1]
    prompts = _prompts(eval_dataset, reg_rows, cfg.eval.num_samples if generates else 0, out_dir, keep)
    tokenizer = load_tokenizer(cfg.model)
    result: dict[str, Any] = {v: old_metrics[v] for v in keep}
    result.update(_evaluate_variants(cfg, run_dir, todo, tokenizer, eval_dataset, prompts, metric_fns))
    ordered = _ordered(cfg, result, prompts, models)
    with outputs.staged(out_dir) as staging:
        _write_outputs(cfg, run_dir, staging, ordered, prompts.rows)
        outputs.write_made_from(staging, models.trained)
    _record_in_run_metrics(run_dir, ordered)
    return ordered


def _record_in_run_metrics(run_dir: Path, ordered: dict[str, Any]) -> None:
    """RUN_DIR/metrics.json's `eval`: each scored model's metrics, beside the training stage's `train`."""
    path = run_dir / rundir.METRICS_FILE
    try:
        doc = json.loads(rundir.read_own_text(path)) if path.is_file() else {}
    except (OSError, ValueError):
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    doc["eval"] = {v: ordered[v] for v in VARIANTS if v in ordered}
    rundir.write_json(path, doc)


def _variants_to_evaluate(cfg: Config, run_dir: Path, variants: Optional[Sequence[str]]) -> list[str]:
    todo = list(variants) if variants is not None else available_variants(cfg, run_dir)
    for v in todo:
        if v not in VARIANTS:
            raise ValueError(f"unknown model variant {v!r}; one of {', '.join(VARIANTS)}")
    return todo


def _prompts(
    eval_dataset: Any, reg_rows: list[dict], num_samples: Optional[int], out_dir: Path, keep: Sequence[str]
) -> _Prompts:
    """The prompts with their sample rows, holding the earlier answers of the models in `keep` only."""
    items = task_items(eval_dataset, num_samples)
    rows = _sample_rows(items, reg_rows, _read_samples(out_dir / rundir.EVAL_SAMPLES_FILE), keep)
    return _Prompts(items, reg_rows, rows)


def _evaluate_variants(
    cfg: Config,
    run_dir: Path,
    todo: list[str],
    tokenizer: Any,
    eval_dataset: Any,
    prompts: _Prompts,
    metric_fns: Sequence[metrics.Metric],
) -> dict[str, Any]:
    """Each variant's scores, one model in memory at a time (an adapter goes onto the base just scored)."""
    result: dict[str, Any] = {}
    model = None
    # The objective's own scores (finetune/core/objectives.py SCORES), with its own settings.
    scorer_class = cfg.objective.spec.scorer_class()
    scorer = scorer_class(cfg, run_dir, eval_dataset, tokenizer, todo) if scorer_class else None
    adapter_on_base = adapter_on_unchanged_base(cfg)
    for v in todo:
        # the trained adapter goes onto the base just scored, unless that base wore init_from's adapter
        reuse = v == "trained" and model is not None and adapter_on_base
        model = attach_adapter(model, trained_dir(cfg, run_dir)) if reuse else None
        if model is None:
            gc.collect()
            model = load_variant(cfg, run_dir, v)
        log.info("evaluating %s", v)
        result[v] = {}
        if cfg.objective.spec.generates_text:
            result[v] = _score_variant(model, tokenizer, eval_dataset, prompts, cfg.eval, metric_fns, v)
            # eval.lm_eval_tasks, on the same model
            result[v].update(lm_eval.scores(cfg.eval, model, tokenizer))
        if scorer is not None:
            answers = [row[v] for row in prompts.rows if row["set"] == "task"]
            result[v].update(scorer.score(model, v, prompts.items, answers))
        if not (v == "base" and "trained" in todo and adapter_on_base):
            model = None  # keep the base only to put the adapter on it next

    model = None
    gc.collect()
    return result


def _score_variant(
    model: Any,
    tokenizer: Any,
    eval_dataset: Any,
    prompts: _Prompts,
    e: EvalConfig,
    metric_fns: Sequence[metrics.Metric],
    v: str,
) -> dict[str, Any]:
    """One model's scores; its answers and regression flags go into the sample rows."""
    scores, answers, reg_answers = evaluate_model(
        model, tokenizer, eval_dataset, prompts.items, prompts.reg_rows, e, metric_fns, v
    )
    task_rows = [r for r in prompts.rows if r["set"] == "task"]
    for row, answer in zip(task_rows, answers):
        row[v] = answer
    reg_sample_rows = [r for r in prompts.rows if r["set"] == "regression"]
    for row, spec, answer in zip(reg_sample_rows, prompts.reg_rows, reg_answers):
        row[v] = answer
        row["flags"][v] = regression.flags(answer, spec["check"], e.refusal_pattern)
    if prompts.reg_rows:
        scores.update(regression.summary(reg_sample_rows, v))
    return scores


def _ordered(cfg: Config, result: dict[str, Any], prompts: _Prompts, models: _Models) -> dict[str, Any]:
    """eval/metrics.json's content: the variants in their order, the regressions against base, the settings,
    which model each variant is and what was not scored."""
    ordered = {v: result[v] for v in VARIANTS if v in result}
    reg_rows_out = [r for r in prompts.rows if r["set"] == "regression"]
    ordered["regression"] = (
        {v: regression.regressions(reg_rows_out, v) for v in VARIANTS if v != "base" and v in result}
        if prompts.reg_rows
        else {}
    )
    ordered.update(lm_eval.deltas(ordered))  # the harness's scores against the base's
    ordered["settings"] = settings(cfg)
    ordered["models"] = {v: models.records[v] for v in VARIANTS if v in result}
    if models.skipped:
        ordered["skipped"] = dict(models.skipped)
    return ordered


def _write_outputs(
    cfg: Config, run_dir: Path, out_dir: Path, ordered: dict[str, Any], rows: list[dict]
) -> None:
    """metrics.json, samples.jsonl, the loss curves and report.md into RUN_DIR/eval/."""
    rundir.write_json(out_dir / rundir.EVAL_METRICS_FILE, ordered)
    rundir.atomic_write_text(
        out_dir / rundir.EVAL_SAMPLES_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    )
    reference = {
        f"{v} held-out loss": ordered[v].get("loss") for v in VARIANTS if v in ordered and v != "merged"
    }
    drawn = curves.plot(run_dir, out_dir / rundir.EVAL_CURVES_FILE, reference)
    write_report(cfg, out_dir / rundir.EVAL_REPORT_FILE, ordered, rows, curves_drawn=drawn is not None)


def show(run_dir: Path) -> None:
    """The table of RUN_DIR/eval/metrics.json on the console, with the regression checks a fine-tuned model
    lost against the base marked and warned about (nothing when there is no evaluation)."""
    from rich.console import Console
    from rich.table import Table

    result = _read_json(rundir.eval_dir(Path(run_dir)) / rundir.EVAL_METRICS_FILE)
    variants = [v for v in VARIANTS if isinstance(result.get(v), dict)]
    if not variants:
        return
    lost = regression.lost_checks(result)
    table = Table(title="evaluation", header_style="bold")
    table.add_column("metric")
    for v in variants:
        table.add_column(v, justify="right")
    for name in metric_names(result):  # a regex metric's name holds brackets: not rich markup
        cells = [_fmt(result[v].get(name)) + _mark(name, lost.get(v)) for v in variants]
        table.add_row(console_text(name), *cells)
    console = Console(stderr=True)
    console.print(table)
    if said := regression.note(result):  # the shares are "-" then: say why
        console.print(console_text(said))
    for v, ids in lost.items():
        console.print(console_text(f"warning: {regression.lost_line(v, ids)}"), style="yellow")


def _mark(name: str, lost: Optional[list[str]]) -> str:
    """The mark beside a regression-check share when the model lost checks the base passes."""
    return " ✗" if lost and name == regression.KEPT_METRIC else ""


def _fmt(value: Any) -> str:
    """A number as read: counts as integers, shares and losses to four places."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)
