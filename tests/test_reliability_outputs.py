"""Outputs know what they were made from, and are written whole.

The trained output records its identity; export/ and eval/ record the one they were made from; an export
made from another model is never scored as `merged`; a retrain moves the old export and evaluation aside;
serve.sh and report.md name the model; the summary shows only what the run wrote. A full disk while a
model folder or the evaluation is saved is one line, exit 2, the previous folder kept and no temporary
folder left.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import (
    SHORT_RUN,
    child_env,
    fast_eval,
    make_adapter_run,
    plan_for,
    prepare_worker_run,
    run_cli,
    tiny_cfg,
)

from finetune.core.config.export import ExportConfig
from finetune.core.errors import DiskFullError
from finetune.modeling import outputs


def _digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` by relative path, hashed: what 'left as it was' means."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob("*") if p.name.endswith((".tmp", ".old")))


def _no_space() -> Exception:
    """What safetensors raises on a full disk (measured on a 64 kB tmpfs): no OSError, the text only."""
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _full_after_writing(path: str, size: int = 4096) -> None:
    """A writer that got `size` bytes out before the disk filled up."""
    Path(path).write_bytes(b"\0" * size)
    raise _no_space()


@pytest.fixture(scope="module")
def held_out(tiny_data):
    return tiny_data[1].select(range(8))


# ---------------------------------------------------------------- identity


def test_identity_is_recorded_and_survives_a_copy_not_a_change(tmp_path, tiny_cache, caplog):
    cfg = tiny_cfg(run_dir=tmp_path / "run")
    adapter = make_adapter_run(tmp_path / "run", cfg.model, cfg.method)
    saved = outputs.record(adapter, 7, "run-a", "adapter")
    assert saved == outputs.identity_of(adapter)
    assert (saved.step, saved.run_id, saved.folder, len(saved.sha256)) == (7, "run-a", "adapter", 64)
    assert saved.describe() == f"adapter/ of step 7 (run run-a, sha256 {saved.sha256[:12]})"

    # Copied without its times (cp, rsync without -t): hashed again, the same bytes, so still step 7.
    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy, copy_function=shutil.copyfile)
    assert outputs.identity_of(copy) == saved

    # One weight changed in place, same size: another model, whose step nobody knows.
    weights = adapter / "adapter_model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="finetune.modeling.outputs"):
        changed = outputs.identity_of(adapter)
    assert changed is not None and changed.sha256 != saved.sha256 and changed.step is None
    assert "files changed since training recorded them (adapter/ of step 7" in caplog.text
    # The tokenizer is not the model: rewriting it changes nothing.
    assert outputs.identity_of(copy) == saved
    (copy / "tokenizer_config.json").write_text("{}")
    assert outputs.identity_of(copy) == saved
    assert outputs.identity_of(tmp_path) is None  # no model files


def test_retire_stale_moves_aside_only_what_another_model_made(tmp_path):
    run = tmp_path / "run"
    a = outputs.Identity("a" * 64, "adapter", 6, "one")
    b = outputs.Identity("b" * 64, "adapter", 3, "two")
    for name, source in (("export", a), ("eval", b)):
        (run / name).mkdir(parents=True)
        (run / name / "marker").write_text(name)
        outputs.write_made_from(run / name, source)
    (run / "superseded-export").mkdir()  # an earlier one: replaced
    (run / "superseded-export" / "older").write_text("x")

    moved = outputs.retire_stale(run, b)
    assert moved == [run / "superseded-export"]
    assert (run / "superseded-export" / "marker").read_text() == "export"
    assert not (run / "superseded-export" / "older").exists() and not (run / "export").exists()
    assert (run / "eval" / "marker").read_text() == "eval"  # made from b: kept
    assert outputs.made_from(run / "superseded-export") == a


# ---------------------------------------------------------------- written whole


def test_staged_replaces_the_folder_whole_or_leaves_it(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")

    with outputs.staged(final, 10) as tmp:
        assert tmp == tmp_path / ".out.tmp" and tmp.is_dir() and not any(tmp.iterdir())
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == ["new.txt"]  # no stale file of the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    with pytest.raises(ValueError, match="boom"), outputs.staged(final) as tmp:
        (tmp / "half.txt").write_text("half")
        raise ValueError("boom")
    assert _digest(final) == {"new.txt": hashlib.sha256(b"new").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    with pytest.raises(DiskFullError) as caught, outputs.staged(final, 5_000_000) as tmp:
        _full_after_writing(str(tmp / "model.safetensors"))
    message = str(caught.value)
    assert message.startswith(f"disk full: {final}: ") and "free, needs about 5.0 MB" in message
    assert "\n" not in message and caught.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (final / "new.txt").is_file()

    # A link planted where the folder goes is replaced, never written through.
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "linked"
    link.symlink_to(target)
    with outputs.staged(link) as tmp:
        (tmp / "x").write_text("x")
    assert not link.is_symlink() and (link / "x").is_file()
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]

    # A temporary folder a killed run left behind is cleared first.
    (tmp_path / ".out.tmp").mkdir()
    (tmp_path / ".out.tmp" / "half-written").write_text("x")
    with outputs.staged(final) as tmp:
        assert not any(tmp.iterdir())
        (tmp / "again.txt").write_text("again")
    assert sorted(p.name for p in final.iterdir()) == ["again.txt"]


def test_torch_write_errors_count_as_a_full_disk_only_when_the_space_is_short(tmp_path):
    final = tmp_path / "model"
    torch_full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    with pytest.raises(DiskFullError), outputs.staged(final, 10**18) as tmp:
        (tmp / "x").write_text("x")
        raise torch_full
    with pytest.raises(RuntimeError, match="unexpected pos"), outputs.staged(final, 10) as tmp:
        raise torch_full  # room to spare: shown as it is
    assert not final.exists() and not list(tmp_path.iterdir())


# ---------------------------------------------------------------- export: provenance and a full disk


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    from finetune.pipeline.cli import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_export_records_its_source_and_a_full_disk_mid_save_keeps_the_previous_export(
    tmp_path, tiny_cache, capsys, monkeypatch
):
    """export/ records the trained output it was made from; a full disk while export saves merged/ is one line,
    exit 2, no traceback, no `.merged.tmp` left, and the previous export whole, merge_check.json included."""
    import transformers.modeling_utils

    run = tmp_path / "run"
    args = [f"run_dir={run}", *SHORT_RUN, "export.evaluate_merged=false"]
    assert _cli(["mode=plan", *args], capsys)[0] == 0
    cfg = tiny_cfg(run_dir=run)
    make_adapter_run(run, cfg.model, cfg.method)
    trained = outputs.record(run / "adapter", 12, "first", "adapter")

    code, out, err = _cli(["mode=export", *args], capsys)
    assert code == 0, err
    export = run / "export"
    assert outputs.made_from(export) == trained
    doc = json.loads((export / "export.json").read_text())
    assert doc["made_from"]["sha256"] == trained.sha256 and doc["made_from"]["step"] == 12
    assert doc["merged"]["path"] == str(export / "merged")  # where it is, not where it was staged
    assert outputs.identity_of(export / "adapter") == trained  # the copy says what it is
    serve = (export / "serve.sh").read_text()
    assert (
        f"# Serves what mode=export made from the trained adapter/ of step 12 (run first, sha256 {trained.short})"
        in serve
    )
    assert f"exported: adapter/ of step 12 (run first, sha256 {trained.short})" in err
    assert _leftovers(run) == []
    before = _digest(export)

    # A new adapter, and the disk fills up while its merged model is saved.
    make_adapter_run(run, cfg.model, cfg.method, seed=1)
    outputs.record(run / "adapter", 20, "second", "adapter")
    monkeypatch.setattr(
        transformers.modeling_utils, "safe_save_file", lambda tensors, path, **kw: _full_after_writing(path)
    )
    code, out, err = _cli(["mode=export", *args], capsys)
    lines = [line for line in err.splitlines() if line.startswith("finetune")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"finetune: error: disk full: {export}: ") and "needs about" in lines[0]
    assert _digest(export) == before  # the previous export whole: its check beside its own model
    assert _leftovers(run) == []


def test_failed_merge_check_leaves_the_previous_export(tmp_path, tiny_cache, held_out):
    from finetune.export import merge
    from finetune.export import stage as export_stage

    run = tmp_path / "run"
    cfg = replace(tiny_cfg(run_dir=run), export=ExportConfig(evaluate_merged=False))
    make_adapter_run(run, cfg.model, cfg.method)
    export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)
    before = _digest(run / "export")
    make_adapter_run(run, cfg.model, cfg.method, seed=1)
    strict = replace(cfg, export=ExportConfig(evaluate_merged=False, tolerance=1e-12))
    with pytest.raises(
        merge.ExportError, match=r"merge check failed: .* top-1 agreement .* nothing was exported"
    ):
        export_stage.run(strict, run, plan_for(strict), eval_dataset=held_out)
    assert _digest(run / "export") == before and _leftovers(run) == []


# ---------------------------------------------------------------- evaluation: never a stale `merged`


def test_an_export_of_another_model_is_not_scored_as_merged(tmp_path, tiny_cache, held_out, caplog):
    from finetune.evaluation import stage as eval_stage
    from finetune.export import stage as export_stage

    run = tmp_path / "run"
    cfg = replace(
        tiny_cfg(run_dir=run), export=ExportConfig(evaluate_merged=False), eval=fast_eval(num_samples=3)
    )
    make_adapter_run(run, cfg.model, cfg.method)
    old = outputs.record(run / "adapter", 40, "old", "adapter")
    export_stage.run(cfg, run, plan_for(cfg), eval_dataset=held_out)

    # Another adapter, put in place by hand (no retrain moved the export aside).
    shutil.rmtree(run / "adapter")
    make_adapter_run(run, cfg.model, cfg.method, seed=1)
    new = outputs.record(run / "adapter", 20, "new", "adapter")
    with caplog.at_level(logging.WARNING, logger="finetune.evaluation.stage"):
        result = eval_stage.run(cfg, run, eval_dataset=held_out)
    doc = json.loads((run / "eval" / "metrics.json").read_text())
    assert list(v for v in ("base", "trained", "merged") if v in doc) == ["base", "trained"]
    assert result["models"]["trained"]["sha256"] == doc["models"]["trained"]["sha256"] == new.sha256
    assert doc["models"]["trained"]["step"] == 20 and "merged" not in doc["models"]
    why = doc["skipped"]["merged"]
    assert why == f"export/merged was made from {old.describe()}, not from the trained {new.describe()}"
    warned = [r.getMessage() for r in caplog.records if "not scored" in r.getMessage()]
    assert warned == [f"eval: {why}: not scored as 'merged'; run mode=export to export this trained model"]
    assert outputs.made_from(run / "eval") == new
    report = (run / "eval" / "report.md").read_text()
    assert f"- **trained**: {new.describe()}, saved {new.saved}" in report
    assert f"- **merged**: not scored: {why}; run mode=export" in report
    assert "| metric | base | trained |" in report

    # Exported again: `merged` is scored, made from the trained model; base and trained kept (same models).
    summary = export_stage.run(replace(cfg, export=ExportConfig()), run, plan_for(cfg), eval_dataset=held_out)
    doc = json.loads((run / "eval" / "metrics.json").read_text())
    assert [v for v in ("base", "trained", "merged") if v in doc] == ["base", "trained", "merged"]
    assert doc["models"]["merged"]["made_from"]["sha256"] == new.sha256 and "skipped" not in doc
    assert doc["trained"] == result["trained"]  # carried over, not re-scored
    assert doc["merged"]["loss"] == pytest.approx(doc["trained"]["loss"], abs=1e-4)
    assert summary["eval"]["merged"] == doc["merged"]
    samples = [json.loads(line) for line in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    assert all({"base", "trained", "merged"} <= set(r) for r in samples)
    report = (run / "eval" / "report.md").read_text()
    assert f"- **merged**: export/merged, made from {new.describe()} (the trained model above)" in report


def test_a_full_disk_while_evaluation_writes_keeps_the_previous_evaluation(
    tmp_path, tiny_cache, held_out, monkeypatch
):
    from finetune.evaluation import stage as eval_stage

    run = tmp_path / "run"
    cfg = replace(tiny_cfg(run_dir=run), eval=fast_eval(num_samples=2, max_new_tokens=2, regression=False))
    make_adapter_run(run, cfg.model, cfg.method)
    eval_stage.run(cfg, run, ["base"], eval_dataset=held_out)
    before = _digest(run / "eval")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eval_stage, "write_report", full)  # after metrics.json and samples.jsonl
    with pytest.raises(DiskFullError, match=f"^disk full: {run / 'eval'}: "):
        eval_stage.run(cfg, run, eval_dataset=held_out)
    assert _digest(run / "eval") == before and _leftovers(run) == []


# ---------------------------------------------------------------- training: the output written whole


def test_a_full_disk_saving_the_trained_adapter_keeps_the_previous_one(
    tmp_path, tiny_cache, capsys, monkeypatch
):
    """One line and exit 2 from the worker (safetensors' error is no OSError, yet no traceback), the
    previous adapter and the export made from it untouched, no temporary folder."""
    import peft.peft_model

    from finetune.train.__main__ import main

    run = prepare_worker_run(
        tmp_path / "run", tmp_path / "cache", "train.max_steps=2", "train.save_steps=100"
    )
    monkeypatch.setattr(logging.getLogger("finetune"), "handlers", [])
    assert main([str(run)]) == 0, capsys.readouterr().err[-3000:]
    first = outputs.identity_of(run / "adapter")
    assert first is not None and first.step == 2
    metrics = json.loads((run / "metrics.json").read_text())["train"]
    assert metrics["run_id"] == first.run_id and metrics["output_identity"]["sha256"] == first.sha256
    (run / "export").mkdir()
    outputs.write_made_from(run / "export", first)  # an export of it, which must stay
    before = _digest(run / "adapter")
    capsys.readouterr()

    real = peft.peft_model.safe_save_file

    def save(tensors, path, *args, **kwargs):
        if ".adapter.tmp" in str(path):
            _full_after_writing(path)
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(peft.peft_model, "safe_save_file", save)
    (run / "config.yaml").write_text(
        (run / "config.yaml").read_text().replace("max_steps: 2", "max_steps: 3")
    )
    code = main([str(run)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("finetune.train:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert (
        lines[0].startswith(f"finetune.train: disk full: {run / 'adapter'}: ") and "needs about" in lines[0]
    )
    assert _digest(run / "adapter") == before and outputs.identity_of(run / "adapter") == first
    assert outputs.made_from(run / "export") == first and _leftovers(run) == []


def test_a_full_disk_building_the_tiny_model_is_one_line(tmp_path):
    from finetune.modeling import cache

    def build(out: Path) -> None:
        _full_after_writing(str(out / "model.safetensors"))

    with pytest.raises(DiskFullError, match=f"^disk full: {tmp_path / 'model-x'}: .* free, needs more space"):
        cache.build_once(tmp_path / "model-x", build)
    assert list(tmp_path.iterdir()) == []  # nothing half-built kept


# ---------------------------------------------------------------- train, export, retrain, evaluate: end to end


def _modes(run: Path, cache: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run}", f"data.cache_dir={cache}", *SHORT_RUN, "eval.num_samples=4", "eval.max_new_tokens=4",
        "eval.progress=false", *extra,
    ]  # fmt: skip


def _summary(stdout: str) -> list[str]:
    return stdout[stdout.index("run directory:") :].splitlines()[1:]


@pytest.mark.slow
def test_retrain_then_eval_never_reports_the_old_export_as_merged(tmp_path, tiny_cache):
    """Full pipeline, `mode=train resume=false` with fewer steps, `mode=eval`, then `mode=export`: which model
    every variant, serve.sh and report.md are, and what each summary prints."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = child_env(FINETUNE_CACHE=str(tiny_cache))

    def cli(*args: str):
        r = run_cli(*_modes(run, cache, *args), env=env, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        return r

    def metrics() -> dict:
        return json.loads((run / "eval" / "metrics.json").read_text())

    cli("train.max_steps=6")
    six = outputs.identity_of(run / "adapter")
    assert six is not None and six.step == 6
    doc = metrics()
    assert doc["models"]["trained"]["sha256"] == doc["models"]["merged"]["made_from"]["sha256"] == six.sha256
    assert f"made from the trained {six.describe()}" in (run / "export" / "serve.sh").read_text()

    # Retrained, shorter: the export and evaluation of step 6 move aside; the summary shows this training only.
    r = cli("mode=train", "resume=false", "train.max_steps=3")
    three = outputs.identity_of(run / "adapter")
    assert three is not None and three.step == 3 and three.sha256 != six.sha256
    assert not (run / "export").exists() and not (run / "eval").exists()
    assert outputs.made_from(run / "superseded-export") == six
    assert (
        "export/ was made from adapter/ of step 6" in r.stderr and "moved to superseded-export/" in r.stderr
    )
    summary = _summary(r.stdout)
    assert [line.strip() for line in summary] == ["config.yaml", "plan.json", "metrics.json", "adapter"]
    # the step-6 scores went aside with their model: the eval stage scores the step-3 one
    assert "eval" not in json.loads((run / "metrics.json").read_text())

    # The old export put back by hand (as a version without provenance left it): evaluated, never as merged.
    shutil.copytree(run / "superseded-export", run / "export")
    r = cli("mode=eval")
    doc = metrics()
    assert "merged" not in doc and doc["models"]["trained"]["sha256"] == three.sha256
    assert doc["skipped"]["merged"].startswith(f"export/merged was made from {six.describe()}")
    assert sum("not scored as 'merged'" in line for line in r.stderr.splitlines()) == 1
    assert "merged" not in " ".join(_summary(r.stdout))
    report = (run / "eval" / "report.md").read_text()
    assert f"- **trained**: {three.describe()}" in report and "- **merged**: not scored:" in report

    # Exported again: merged is the step-3 model, serve.sh says so; the summary shows the merged model only.
    r = cli("mode=export")
    doc = metrics()
    assert doc["models"]["merged"]["made_from"]["sha256"] == three.sha256 and "skipped" not in doc
    assert doc["merged"]["loss"] == pytest.approx(doc["trained"]["loss"], abs=1e-3)
    assert f"made from the trained {three.describe()}" in (run / "export" / "serve.sh").read_text()
    assert (
        f"- **merged**: export/merged, made from {three.describe()} (the trained model above)"
        in (run / "eval" / "report.md").read_text()
    )
    summary = _summary(r.stdout)
    written = {line.strip() for line in summary if line.startswith("  ")}
    assert {"export/merged", "export/serve.sh", "eval/metrics.json", "eval/report.md"} <= written
    assert f"evaluation: {run / 'eval' / 'report.md'}, {run / 'eval' / 'loss_curves.png'}" in summary[-1]
    assert _leftovers(run) == []
