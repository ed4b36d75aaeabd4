"""SmolLM2-135M-Instruct's recipe: the task gain against the regression checks kept, one row per setting.

    python scripts/bench_retention.py --out /tmp/retention                 # every setting, one after another
    python scripts/bench_retention.py --out /tmp/retention --only task400-lr1e-4   # one (run several in parallel)
    python scripts/bench_retention.py --out /tmp/retention --table          # the table of the rows done
    python scripts/bench_retention.py --out /tmp/retention --first-sentence # base passes the first sentence fails

Each setting is `+recipe=smollm2_135m_lora` with its overrides, run through the real command line:
`mode=data`, then `mode=train` (the launcher and the training worker, its own generation turned off by
eval.num_samples=0: this script scores the models). Then this process scores base (once per data set) and
trained as mode=eval does (`finetune.evaluation.stage.evaluate_model`: held-out loss, greedy answers to the
first 96 held-out prompts and to the regression set, the model's own chat template). Each row is written
to OUT/NAME/retention.json (the commands' output to OUT/NAME.log); the table (markdown) goes to stdout. Minutes a setting on 2 free cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPE = "+recipe=smollm2_135m_lora"
NUM_SAMPLES = 96
# name -> (task conversations mixed with the replay ones, overrides of the recipe). The task rows are
# scripts/make_bundled_data.py --rows N --seed 1 (the recipe's finetune/data/smollm2/task.jsonl is N = 400); the
# replay is finetune/data/smollm2/replay.jsonl as committed (the base's answers, checked by
# scripts/make_replay_data.py).
SETTINGS: dict[str, tuple[int, list[str]]] = {
    "task400-lr1e-3": (400, ["method.learning_rate=1e-3"]),
    "task400-lr1e-3-attn": (
        400,
        ["method.learning_rate=1e-3", "method.target_modules=[q_proj,k_proj,v_proj,o_proj]"],
    ),
    "task400-lr5e-4": (400, ["method.learning_rate=5e-4"]),
    "task400-lr1e-3-steps20": (400, ["method.learning_rate=1e-3", "train.max_steps=20"]),
    "task400-lr1e-3-steps15": (400, ["method.learning_rate=1e-3", "train.max_steps=15"]),
    # more replay per task conversation, a lower rate, a lower rank
    "task200-lr1e-3": (200, ["method.learning_rate=1e-3"]),
    "task200-lr1e-3-steps15": (200, ["method.learning_rate=1e-3", "train.max_steps=15"]),
    "task200-lr3e-4": (200, ["method.learning_rate=3e-4"]),
    "task400-lr3e-4": (400, ["method.learning_rate=3e-4"]),
    "task200-r4-lr1e-3": (200, ["method.learning_rate=1e-3", "method.lora_rank=4", "method.lora_alpha=8"]),
}


def _data(rows: int, out: Path) -> Path:
    """A folder with `rows` task conversations and the replay ones (the recipe's mix, resized)."""
    folder = out / f"data-task{rows}"
    if not (folder / "replay.jsonl").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        make = [sys.executable, str(REPO / "scripts" / "make_bundled_data.py"), "--rows", str(rows)]
        subprocess.run([*make, "--seed", "1", "--out", str(folder / "task.jsonl")], check=True)
        shutil.copy(REPO / "finetune" / "data" / "smollm2" / "replay.jsonl", folder / "replay.jsonl")
    return folder


def _cli(args: list[str], log: Path) -> None:
    with open(log, "a") as f:
        r = subprocess.run([sys.executable, "-m", "finetune", *args], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"python -m finetune {' '.join(args)} exited {r.returncode}; see {log}")


def _score(cfg, run_dir: Path, variant: str, model=None) -> dict:
    from finetune.core import metrics
    from finetune.data.stage import load_prepared
    from finetune.evaluation import regression
    from finetune.evaluation.stage import evaluate_model, task_items
    from finetune.modeling.models import load_tokenizer
    from finetune.modeling.variants import load_variant

    e = cfg.eval
    tokenizer = load_tokenizer(cfg.model)
    eval_ds = load_prepared(run_dir)[1]
    items = task_items(eval_ds, NUM_SAMPLES)
    reg_rows = regression.load(e.regression_prompts)
    model = load_variant(cfg, run_dir, variant)
    scores, answers, reg_answers = evaluate_model(
        model, tokenizer, eval_ds, items, reg_rows, e, metrics.resolve(e.metrics), variant
    )
    checks = {
        r["id"]: "check_failed" not in regression.flags(a, r["check"], e.refusal_pattern)
        for r, a in zip(reg_rows, reg_answers)
        if r.get("check")
    }
    return {
        "scores": scores,
        "checks": checks,
        "regression_answers": dict(zip([r["id"] for r in reg_rows], reg_answers)),
        "task_answers": [[it["prompt"], it["reference"], a] for it, a in zip(items, answers)],
    }


def run_setting(name: str, out: Path) -> dict:
    from finetune.core.composition import compose

    run_dir = out / name
    out.mkdir(parents=True, exist_ok=True)
    rows, settings = SETTINGS[name]
    overrides = [RECIPE, *settings, f"data.path={_data(rows, out)}", f"run_dir={run_dir}"]
    overrides += ["eval.num_samples=0", "eval.progress=false"]
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    _cli([*overrides, "mode=data"], log)
    _cli([*overrides, "mode=train"], log)
    train_s = time.perf_counter() - t0
    cfg = compose([*overrides[:-2], f"eval.num_samples={NUM_SAMPLES}"])
    # the base answers the same prompts whatever the training: scored once per held-out split
    split = hashlib.sha256((run_dir / "data_stats.json").read_bytes()).hexdigest()[:12]
    base_file = out / f"base-{split}.json"
    if not base_file.is_file():
        base_file.write_text(json.dumps(_score(cfg, run_dir, "base")))
    base = json.loads(base_file.read_text())
    trained = _score(cfg, run_dir, "trained")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    passed = [k for k, ok in base["checks"].items() if ok]
    row = {
        "name": name,
        "task_rows": rows,
        "replay_rows": len((out / f"data-task{rows}" / "replay.jsonl").read_text().splitlines()),
        "overrides": settings,
        "train_seconds": round(train_s, 1),
        "peak_memory_gb": metrics["train"].get("peak_memory_gb"),
        "base": base["scores"],
        "trained": trained["scores"],
        "base_checks_passed": len(passed),
        "checks_kept": sum(trained["checks"][k] for k in passed),
        "lost": {k: trained["regression_answers"][k] for k in passed if not trained["checks"][k]},
        "task_answers": trained["task_answers"][:12],
    }
    (run_dir / "retention.json").write_text(json.dumps(row, indent=1))
    return row


def table(out: Path) -> str:
    lines = [
        "| task rows + replay | overrides | task exact match (base -> trained) | held-out loss (base -> trained) "
        "| regression checks kept |",
        "|---|---|---|---|---|",
    ]
    for name in SETTINGS:
        f = out / name / "retention.json"
        if not f.is_file():
            continue
        r = json.loads(f.read_text())
        b, t = r["base"], r["trained"]
        kept = r["checks_kept"] / r["base_checks_passed"]
        lines.append(
            f"| {r['task_rows']} + {r.get('replay_rows', 156)} | {' '.join(r['overrides'])} | {b['exact_match_tasks']:.2f} -> {t['exact_match_tasks']:.2f} "
            f"| {b['loss']:.2f} -> {t['loss']:.2f} | {kept:.2f} ({r['checks_kept']} of {r['base_checks_passed']}) |"
        )
    return "\n".join(lines)


def first_sentence_table(out: Path) -> str:
    """The checks the base passes whose answer's first sentence alone fails them (OUT/base-*.json): the checks a
    model that learns the replay's one-sentence answers (scripts/make_replay_data.py keeps the first sentence)
    can lose while keeping what the base knew, because the base reaches the answer only after that sentence. The
    format checks are left out."""
    from finetune.core.composition import compose
    from finetune.evaluation import regression
    from scripts.make_replay_data import _sentences

    pattern = compose([RECIPE]).eval.refusal_pattern
    # the format checks (lists, JSON, a poem) are answered on several lines, as the replay's lists are: left out
    rows = {r["id"]: r for r in regression.load() if r.get("check") and r["category"] != "format"}
    lines = [
        "| base answers (split) | checks passed (format checks left out) | passed, first sentence alone fails | those checks |",
        "|---|---:|---:|---|",
    ]
    for f in sorted(out.glob("base-*.json")):
        answers = json.loads(f.read_text())["regression_answers"]
        passed = [
            k
            for k, r in rows.items()
            if "check_failed" not in regression.flags(answers[k], r["check"], pattern)
        ]
        fragile = []
        for k in passed:
            first = _sentences(answers[k], 1) or answers[k].strip().split("\n")[0].strip()
            if "check_failed" in regression.flags(first, rows[k]["check"], pattern):
                fragile.append(f"{k}: {first[:60]!r}")
        lines.append(f"| {f.stem} | {len(passed)} | {len(fragile)} | {'; '.join(fragile)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", choices=sorted(SETTINGS), default=None)
    parser.add_argument("--table", action="store_true", help="print the table of the rows done, run nothing")
    parser.add_argument(
        "--first-sentence", action="store_true", help="print which base passes its first sentence alone fails"
    )
    args = parser.parse_args(argv)
    if args.first_sentence:
        print(first_sentence_table(args.out))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.table:
        for name in args.only or list(SETTINGS):
            row = run_setting(name, args.out)
            print(f"{name}: kept {row['checks_kept']} of {row['base_checks_passed']}", flush=True)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
