"""The run directory, its scripts, checkpoints and reports against a hostile or unlucky user.

- no write follows a link finetune did not make: a planted symlink, hard link, FIFO or folder at any file
  the project writes, or a symlinked folder on the way inside the run directory, is refused in one line
  (exit 2) and its target is unchanged; the ownership check counts every entry;
- user text is escaped wherever it is rendered (report.md, compare.md, the plan and other consoles, plots);
- every printed or commented command is quoted: pasted into a shell it runs itself and nothing else;
- a checkpoint damaged consistently with its manifest (a trainer state that is not JSON, a refused pickle
  payload, a bad safetensors header) is skipped in one line naming it and what is used instead.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shlex
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import SEQ_LEN, Capture, planned, planned_run_dir, prepare_run, tiny_cfg, write_log_history

from finetune import rundir
from finetune.core import markup
from finetune.core.errors import ConfigError, LaunchError
from finetune.rundir import checkpoints

PRECIOUS = "precious: must never change\n"
HOSTILE = "<img src=x onerror=alert(1)> a|b\nnext `code` [link](javascript:alert(1)) *b* \x1b[31mred x[/]y"


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    from finetune.pipeline.cli import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _precious(tmp_path: Path) -> Path:
    path = tmp_path / "precious"
    path.write_text(PRECIOUS)
    return path


def _owned_run_dir(tmp_path: Path) -> Path:
    """A run directory as finetune marks it (not yet locked in this process)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.OWNER_FILE).write_text("written by finetune\n")
    return run


def _plant(kind: str, at: Path, target: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        at.symlink_to(target)
    elif kind == "hardlink":
        os.link(target, at)
    elif kind == "fifo":
        os.mkfifo(at)
    elif kind == "folder":
        at.mkdir()
    else:
        raise AssertionError(kind)


# ---------------------------------------------------------------- no write follows a planted link


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "folder"])
def test_a_planted_lock_is_refused_and_its_target_unchanged(tmp_path, capsys, kind):
    """`ln -s ~/precious RUN_DIR/.lock` and its neighbours (a hard link, a FIFO, a folder), in a run directory of ours."""
    precious, run = _precious(tmp_path), _owned_run_dir(tmp_path)
    _plant(kind, run / rundir.LOCK_FILE, precious)
    code, _, err = _cli(["mode=plan", f"run_dir={run}"], capsys)
    line = _one_line(err)
    assert code == 2 and f"{run / rundir.LOCK_FILE}: " in line and "finetune did not make" in line, line
    assert precious.read_text() == PRECIOUS
    assert not (run / rundir.PLAN_FILE).exists() and not (run / rundir.CONFIG_FILE).exists()


@pytest.mark.parametrize(
    "planted",
    [(rundir.LOCK_FILE, "symlink"), (rundir.OWNER_FILE, "symlink"), (rundir.OWNER_FILE, "hardlink")],
)
def test_a_folder_holding_only_a_planted_lock_or_marker_is_not_ours(tmp_path, capsys, planted):
    """`mkdir rd; ln -s ~/precious rd/.lock` does not pass the ownership check: every entry counts."""
    name, kind = planted
    precious = _precious(tmp_path)
    run = tmp_path / "rd"
    _plant(kind, run / name, precious)
    assert not rundir.is_owned(run)
    code, _, err = _cli(["mode=plan", f"run_dir={run}"], capsys)
    line = _one_line(err)
    assert code == 2 and "not a finetune run directory" in line and f"it holds {name}" in line, line
    assert precious.read_text() == PRECIOUS and sorted(p.name for p in run.iterdir()) == [name]


def test_a_run_dir_or_marker_of_another_user_is_not_ours(tmp_path, monkeypatch):
    run = _owned_run_dir(tmp_path)
    assert rundir.is_owned(run)
    rundir.check_run_dir(run)
    owner = run.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)  # this process runs as someone else
    assert not rundir.is_owned(run)
    with pytest.raises(ConfigError, match=rf"run_dir={re.escape(str(run))}: a folder owned by another user"):
        rundir.check_run_dir(run)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root (a container on a mounted folder) may use it
    rundir.check_run_dir(run)


# Every file `mode=launch launch.dry_run=true` (or the SLURM variant) writes into the run directory.
LAUNCH_FILES = [
    (rundir.CONFIG_FILE, ()),
    (rundir.PLAN_FILE, ()),
    (rundir.ENGINE_FILE, ()),
    (rundir.LAUNCH_SCRIPT, ()),
    (rundir.SBATCH_FILE, ("launch.scheduler=slurm",)),
]


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
@pytest.mark.parametrize("name, extra", LAUNCH_FILES, ids=[n for n, _ in LAUNCH_FILES])
def test_every_file_the_launcher_writes_refuses_a_planted_link(tmp_path, capsys, name, extra, kind):
    precious, run = _precious(tmp_path), _owned_run_dir(tmp_path)
    _plant(kind, run / name, precious)
    code, _, err = _cli(["mode=launch", "launch.dry_run=true", f"run_dir={run}", *extra], capsys)
    line = _one_line(err)
    assert code == 2 and f"{name}: " in line and "finetune did not make" in line, line
    assert precious.read_text() == PRECIOUS
    assert (run / name).is_symlink() if kind == "symlink" else os.stat(run / name).st_nlink == 2


def test_a_symlinked_folder_inside_the_run_dir_is_refused_outside_it_the_users_own(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    run = _owned_run_dir(tmp_path)
    rundir.lock(run)
    (run / rundir.EVAL_DIR).symlink_to(victim)
    with pytest.raises(LaunchError, match=rf"^{re.escape(str(run / rundir.EVAL_DIR))}: a symbolic link"):
        rundir.atomic_write_text(run / rundir.EVAL_DIR / rundir.EVAL_REPORT_FILE, "report")
    (run / "export").mkdir()
    (run / "export" / "deep").symlink_to(victim)
    with pytest.raises(LaunchError, match="deep: a symbolic link"):
        rundir.write_json(
            run / "export" / "deep" / "more" / "x.json", {}
        )  # no folder made in the victim either
    assert list(victim.iterdir()) == []
    # Outside a run directory (plan.out=...) the path is the user's, links and all.
    mine = tmp_path / "mine"
    mine.symlink_to(victim)
    rundir.write_json(mine / "plan.json", {"a": 1})
    assert json.loads((victim / "plan.json").read_text()) == {"a": 1}


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "folder"])
def test_an_atomic_write_refuses_what_it_would_replace_or_block_on(tmp_path, kind):
    precious = _precious(tmp_path)
    target = tmp_path / "out" / "metrics.json"
    _plant(kind, target, precious)
    with pytest.raises(
        LaunchError, match=rf"^{re.escape(str(target))}: .*finetune did not make; nothing was"
    ):
        rundir.write_json(target, {"loss": 1.0})
    assert precious.read_text() == PRECIOUS
    assert sorted(p.name for p in target.parent.iterdir()) == ["metrics.json"]  # no temporary file left


def _checkpoint(folder: Path, step: int) -> Path:
    """A sealed checkpoint holding what the trainer writes and reads back, each file readable as it reads it."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    staged = folder / checkpoints.STAGING_DIR / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    state = {"global_step": step, "log_history": [{"step": step, "loss": 1.0}], "stateful_callbacks": {}}
    (staged / checkpoints.TRAINER_STATE_FILE).write_text(json.dumps(state))
    torch.save({"state": {0: {"exp_avg": torch.zeros(8)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
               staged / "optimizer.pt")  # fmt: skip
    torch.save({"last_epoch": step, "_last_lr": [1e-4]}, staged / "scheduler.pt")
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, staged / "rng_state.pth")
    save_file(
        {"base_model.model.lora_A.weight": torch.zeros(4, 4)}, str(staged / "adapter_model.safetensors")
    )
    (staged / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    # Written by the trainer, never read back: any pickle is fine here.
    (staged / "training_args.bin").write_bytes(pickle.dumps(Path("/anything")))
    return checkpoints.finalize(staged, folder / f"checkpoint-{step}")


def test_links_among_the_checkpoints_are_refused_and_their_targets_kept(tmp_path):
    run = _owned_run_dir(tmp_path)
    rundir.lock(run)
    folder = rundir.checkpoint_dir(run)
    _checkpoint(folder, 4)
    elsewhere = _checkpoint(tmp_path / "other-run", 9)  # complete, verifiable: resume would pick it
    (folder / "checkpoint-9").symlink_to(elsewhere)
    assert [p.name for p in checkpoints.listing(folder)] == ["checkpoint-4"]
    for resume in (True, False):  # resume=false would have deleted what the link points to
        with pytest.raises(LaunchError, match=r"checkpoint-9: a symbolic link .*finetune did not make"):
            checkpoints.prepare_resume(resume, folder)
    assert checkpoints.verify(elsewhere) is None and (folder / "checkpoint-4").is_dir()

    victim = tmp_path / "victim"
    victim.mkdir()
    (folder / "checkpoint-9").unlink()
    (folder / checkpoints.STAGING_DIR).rmdir()  # left empty by the last save
    (folder / checkpoints.STAGING_DIR).symlink_to(victim)  # where the trainer writes the next checkpoint
    with pytest.raises(LaunchError, match=r"\.staging: a symbolic link"):
        rundir.make_fresh_folder(folder / checkpoints.STAGING_DIR / "checkpoint-8")
    assert list(victim.iterdir()) == []

    ckpt = folder / "checkpoint-4"
    (ckpt / "scheduler.pt").unlink()
    (ckpt / "scheduler.pt").symlink_to(elsewhere / "scheduler.pt")  # same bytes, someone else's file
    assert "scheduler.pt is not a regular file" in checkpoints.verify(ckpt)


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory, tiny_cache) -> Path:
    """A run directory as mode=data leaves it for mode=train (config, data, plan, engine files)."""
    root = tmp_path_factory.mktemp("prepared")
    return prepare_run(
        tiny_cfg(f"data.cache_dir={root / 'cache'}", "train.max_steps=2", run_dir=root / "run")
    )


# Where training writes in place (the trainer, tokenizers, TensorBoard), and what is planted there.
TRAINING_OUTPUTS = [
    ("adapter/adapter_model.safetensors", "symlink", "file"),
    ("adapter", "symlink", "folder"),
    ("tensorboard", "symlink", "folder"),
    ("tensorboard/events.out.tfevents.1", "hardlink", "file"),
    (rundir.METRICS_FILE, "symlink", "file"),
    (rundir.PROFILE_FILE, "hardlink", "file"),
    ("checkpoints", "symlink", "folder"),
]


@pytest.mark.parametrize(
    "name, kind, target", TRAINING_OUTPUTS, ids=[f"{n}-{k}" for n, k, _ in TRAINING_OUTPUTS]
)
def test_mode_train_refuses_a_link_where_training_writes_before_it_starts(
    tmp_path, prepared_run, capsys, name, kind, target
):
    """A planted link where training writes stops mode=train in one line before any rank starts: nothing
    trained, the target unchanged."""
    import shutil

    precious, victim = _precious(tmp_path), tmp_path / "victim"
    victim.mkdir()
    run = tmp_path / "run"
    shutil.copytree(prepared_run, run, symlinks=True, ignore=shutil.ignore_patterns(rundir.LOCK_FILE))
    _plant(kind, run / name, victim if target == "folder" else precious)
    code, _, err = _cli(["mode=train", f"run_dir={run}", SEQ_LEN, "train.max_steps=2"], capsys)
    line = _one_line(err)
    assert code == 2 and f"{run / name}: " in line and "finetune did not make" in line, line
    assert precious.read_text() == PRECIOUS and list(victim.iterdir()) == []
    assert not (run / "checkpoints" / "checkpoint-2").exists() and not (run / rundir.ENGINE_FILE).is_symlink()


def test_detach_refuses_a_planted_log_or_pid_file_before_starting(tmp_path):
    from finetune.launch import stage as launch_stage

    precious = _precious(tmp_path)
    cfg, plan, run = planned_run_dir(tmp_path, SEQ_LEN)
    for name, which in ((rundir.LAUNCH_LOG, "/usr/bin/tmux"), (rundir.LAUNCH_PID_FILE, None)):
        (run / name).symlink_to(precious)
        runner = Capture()
        with pytest.raises(LaunchError, match=rf"{re.escape(name)}: a symbolic link"):
            launch_stage.run(cfg, run, plan, launch=replace(cfg.launch, detach=True), runner=runner,
                             which=lambda _, w=which: w)  # fmt: skip
        assert runner.calls == [] and precious.read_text() == PRECIOUS
        (run / name).unlink()


# ---------------------------------------------------------------- user text escaped wherever it is rendered


def test_markdown_escaping_keeps_the_text_and_none_of_its_markup():
    cell = markup.markdown_cell(HOSTILE)
    assert "<" not in cell and ">" not in cell and "\n" not in cell and "\x1b" not in cell
    assert "&lt;img src=x onerror=alert(1)&gt;" in cell
    assert re.search(r"(?<!\\)\|", cell) is None  # every | escaped: the cell cannot end early
    assert r"\`code\`" in cell and r"\[link\](javascript:alert(1))" in cell and r"\*b\*" in cell
    assert markup.markdown_cell("a" * 100, 10) == "a" * 9 + "…"
    assert markup.markdown_cell("<" * 20, 5) == "&lt;" * 4 + "…"  # cut before escaping: no half entity
    assert markup.markdown_text("exact_match 0.5") == "exact_match 0.5"  # plain text stays as it is
    assert markup.terminal_text("a\x1b]0;title\x07b\nc") == "a?]0;title?b\nc"
    assert markup.terminal_line("one\ntwo\tthree") == "one two three"
    assert markup.plot_text("a$x$b") == r"a\$x\$b"


def test_report_md_shows_hostile_data_as_text(tmp_path):
    from finetune.evaluation.report import write_report

    cfg = tiny_cfg()
    result = {
        "base": {"loss": 2.0, "regex:<b>[a-z]+</b>": 0.1},
        "trained": {"loss": 1.0, "regex:<b>[a-z]+</b>": 0.9},
    }
    rows = [{"set": "task", "prompt": HOSTILE, "reference": "ref|erence\n", "base": "<script>x</script>",
             "trained": "`<iframe src=//evil>`"}]  # fmt: skip
    path = tmp_path / "report.md"
    write_report(cfg, path, result, rows, curves_drawn=False)
    text = path.read_text()
    assert not re.search(r"<(img|script|iframe|b>)", text), text
    assert "&lt;img src=x onerror=alert(1)&gt;" in text and "&lt;script&gt;x&lt;/script&gt;" in text
    table = [line for line in text.splitlines() if line.startswith("|")]
    widths = {len(re.findall(r"(?<!\\)\|", line)) for line in table[:4]}  # metric table: header, rule, rows
    assert widths == {len(re.findall(r"\|", table[0]))}, table[:4]
    examples = [line for line in table if "onerror" in line]
    assert len(examples) == 1 and len(re.findall(r"(?<!\\)\|", examples[0])) == 5  # 4 cells, one row


def test_compare_md_and_console_show_hostile_names_and_values_as_text(tmp_path):
    from rich.console import Console

    from finetune.pipeline import compare

    table = {
        "runs": [{"name": "<img src=x onerror=alert(1)>", "path": "a", "source": "s"},
                 {"name": "x[/]y", "path": "b", "source": "s"}],
        "rows": [{"key": "data.path", "kind": "config", "values": ["a|b\nc", "[red]z[/red]"], "best": None},
                 {"key": "trained.loss", "kind": "metric", "values": [1.0, 0.5], "best": 1}],
    }  # fmt: skip
    md = compare.markdown(table)
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt;" in md and r"x\[/\]y" in md
    for line in md.splitlines()[:4]:
        assert len(re.findall(r"(?<!\\)\|", line)) == 4, line
    console = Console(record=True, width=200)
    compare.print_table(table, console)  # rich raised MarkupError on `[/]`
    text = console.export_text()
    assert "x[/]y" in text and "[red]z[/red]" in text


def test_plan_and_eval_consoles_print_brackets_and_escapes_literally(capsys, tmp_path):
    from rich.console import Console

    from finetune.evaluation.stage import show
    from finetune.pipeline.plan_report import print_plan

    _, plan = planned(SEQ_LEN)
    plan = replace(plan, reasons=("model.config_path=/x/[/]y \x1b[2J", *plan.reasons))
    console = Console(record=True, width=300)
    print_plan(plan, title="run x[/] [bold]y", console=console)
    text = console.export_text()
    assert "run x[/] [bold]y" in text and "model.config_path=/x/[/]y ?[2J" in text and "\x1b[2J" not in text
    capsys.readouterr()
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "metrics.json").write_text(json.dumps({"base": {"regex:[a-z]+": 0.5, "x[/]": 1.0}}))
    show(tmp_path)  # eaten as a style, or MarkupError
    err = capsys.readouterr().err
    assert "regex:[a-z]+" in err and "x[/]" in err


def test_loss_curves_draw_a_run_dir_named_like_mathtext(tmp_path):
    from finetune.evaluation import curves

    run = tmp_path / "a$\\frac{$b"
    write_log_history(run)
    out = run / "eval" / "loss_curves.png"
    assert curves.plot(run, out, {"base $x$ loss": 2.0}) == {"train": 20, "eval": 4}
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_refusal_naming_a_value_with_a_newline_stays_one_line(tmp_path, capsys):
    code, _, err = _cli(
        ["mode=plan", f"run_dir={tmp_path / 'run'}", "model.config_path='/no\nsuch.json'"], capsys
    )
    assert code == 2 and "model.config_path=/no such.json: no such file" in _one_line(err)


# ---------------------------------------------------------------- shown commands are quoted


def _words(line: str, cwd: Path) -> list[str]:
    """The words bash makes of `line` (as a pasted command line), by running it with printf in front."""
    done = subprocess.run(["bash", "-c", f"set -- {line}; printf '%s\\0' \"$@\""], cwd=cwd,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\0")[:-1]


def _after(text: str, marker: str, end: str = "\n") -> str:
    start = text.index(marker) + len(marker)
    return text[start : text.index(end, start)]


HOSTILE_DIR = "r $(touch PWNED) `touch PWNED` ; touch PWNED"


def test_every_command_launch_prints_or_comments_runs_only_itself(tmp_path, capsys):
    run = tmp_path / HOSTILE_DIR
    code, out, err = _cli(["mode=launch", "launch.dry_run=true", f"run_dir='{run}'"], capsys)
    assert code == 0, err
    script = run / rundir.LAUNCH_SCRIPT
    comment = _after(script.read_text(), "re-run as is: ")
    assert _words(comment, tmp_path) == ["bash", str(script)]
    assert _words(_after(out, "script: "), tmp_path) == [str(script)]
    code, out, err = _cli(["mode=launch", "launch.dry_run=true", "launch.scheduler=slurm", f"run_dir='{run}'"],
                          capsys)  # fmt: skip
    assert code == 0, err
    sbatch = run / rundir.SBATCH_FILE
    assert _words(_after(sbatch.read_text(), "submit: "), tmp_path) == ["sbatch", str(sbatch)]
    assert _words(_after(out, "dry run: not submitted (", ")\n"), tmp_path) == ["sbatch", str(sbatch)]
    assert not (tmp_path / "PWNED").exists()


def test_other_nodes_and_detach_lines_run_only_themselves(tmp_path, capsys):
    from finetune.launch.runner import detach

    run = tmp_path / HOSTILE_DIR
    args = ["+recipe=llama70b_full", "hardware.nodes=2", "launch.master_addr=10.0.0.1", "mode=launch",
            "launch.dry_run=true", f"run_dir='{run}'"]  # fmt: skip
    code, out, err = _cli(args, capsys)
    assert code == 0, err
    line = _after(out, "on the other nodes (1): ", "  (or").replace("<rank>", "1")
    assert _words(line, tmp_path) == ["NODE_RANK=1", "bash", str(run / rundir.LAUNCH_SCRIPT)]
    script, log = run / rundir.LAUNCH_SCRIPT, run / rundir.LAUNCH_LOG
    for which in ("/usr/bin/tmux", None):
        shown = "\n".join(detach(script, log, "ft-x", Capture(), lambda _, w=which: w)) + "\n"
        assert _words(_after(shown, "follow:  "), tmp_path) == ["tail", "-f", str(log)]
    assert _words(_after(shown, "stop:    kill $(", ")\n"), tmp_path) == [
        "cat",
        str(run / rundir.LAUNCH_PID_FILE),
    ]
    assert not (tmp_path / "PWNED").exists()


def test_resume_hints_in_messages_run_only_themselves(tmp_path):
    from finetune.train.resume import Preempted, interrupted_message

    run = tmp_path / HOSTILE_DIR
    run.mkdir()
    worker = ["python", "-m", "finetune.train", str(run)]
    assert (
        _words(_after(str(Preempted("SIGTERM", 3, None, run)), "(or: ", "); resume=false"), tmp_path)
        == worker
    )
    assert _words(_after(interrupted_message("SIGTERM", run) + "\n", "(or: ", ")\n"), tmp_path) == worker
    with pytest.raises(LaunchError) as missing:
        rundir.load_plan(run)
    hint = _after(str(missing.value), "run the plan stage (", ") first")
    assert _words(hint, tmp_path) == ["python", "-m", "finetune", "mode=plan", f"run_dir={run}"]
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------- damaged checkpoints: one line, a fallback


class _Payload:
    """Pickled, it runs `touch PWNED` when loaded without weights_only."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.target))}",))


def _reseal(ckpt: Path) -> None:
    """Rewrite the manifest over the damaged files: the checksums match, only the content is wrong."""
    checkpoints.write_manifest(ckpt, checkpoints.step_of(ckpt))
    checkpoints._verified.clear()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zero_header(path: Path) -> None:
    path.write_bytes(b"\0" * 64 + path.read_bytes()[64:])


def _payload(path: Path, pwned: Path) -> None:
    import torch

    torch.save(_Payload(pwned), path)


DAMAGES = [
    ("trainer_state_not_json", lambda c, t: (c / "trainer_state.json").write_text("{not json"), "trainer_state.json: not JSON"),
    ("trainer_state_a_list", lambda c, t: (c / "trainer_state.json").write_text("[]"), "trainer_state.json: no global_step"),
    ("trainer_state_unknown_keys", lambda c, t: (c / "trainer_state.json").write_text('{"global_step": 8, "x": 1}'),
     "trainer_state.json: not a trainer state"),
    ("no_trainer_state", lambda c, t: (c / "trainer_state.json").unlink(), "no trainer_state.json"),
    ("optimizer_pickle_payload", lambda c, t: _payload(c / "optimizer.pt", t),
     "optimizer.pt cannot be read (UnpicklingError"),
    ("rng_pickle_payload", lambda c, t: _payload(c / "rng_state.pth", t),
     "rng_state.pth cannot be read (UnpicklingError"),
    ("scheduler_truncated", lambda c, t: _truncate(c / "scheduler.pt"), "scheduler.pt cannot be read"),
    ("adapter_header_zeroed", lambda c, t: _zero_header(c / "adapter_model.safetensors"),
     "adapter_model.safetensors cannot be read (SafetensorError"),
    ("adapter_config_not_json", lambda c, t: (c / "adapter_config.json").write_text("{"),
     "adapter_config.json cannot be read (JSONDecodeError"),
]  # fmt: skip


def test_a_complete_checkpoint_verifies_rng_state_and_training_args_included(tmp_path):
    """No false alarm: the numpy RNG state loads under transformers' allowlist; training_args.bin is never read."""
    assert checkpoints.verify(_checkpoint(tmp_path, 4)) is None


@pytest.mark.parametrize("case, damage, reason", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_a_checkpoint_damaged_with_a_matching_manifest_is_skipped_in_one_line(
    tmp_path, caplog, case, damage, reason
):
    folder = tmp_path / "checkpoints"
    _checkpoint(folder, 4)
    newest = _checkpoint(folder, 8)
    pwned = tmp_path / "PWNED"
    damage(newest, pwned)
    _reseal(newest)
    assert checkpoints.verify(newest, checksums=False) is None  # sizes match: rotation keeps it
    assert reason in checkpoints.verify(newest)
    with caplog.at_level(logging.WARNING, logger="finetune.rundir.checkpoints"):
        assert checkpoints.last_complete(folder) == folder / "checkpoint-4"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(newest) in lines[0] and reason in lines[0], lines
    assert lines[0].endswith("resuming from checkpoint-4 instead")
    with pytest.raises(
        ConfigError, match=r"resume=checkpoint-8: damaged checkpoint .* resume=true resumes from checkpoint-4"
    ):
        checkpoints.resume_checkpoint("checkpoint-8", folder)
    assert not pwned.exists()  # the payload never ran


def test_a_deepspeed_shard_naming_code_is_refused_without_running_it(tmp_path):
    """DeepSpeed loads its shards without weights_only: their pickles are read for what they would call."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    folder = tmp_path / "checkpoints"
    _checkpoint(folder, 4)
    ckpt = _checkpoint(folder, 8)
    shard = ckpt / "global_step8" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.parent.mkdir()
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(1.0)}, "ds_version": "0.19.8"}, shard)
    _reseal(ckpt)
    assert checkpoints.verify(ckpt) is None  # DeepSpeed's own classes, as its ZeRO-3 checkpoints hold
    pwned = tmp_path / "PWNED"
    _payload(shard, pwned)
    _reseal(ckpt)
    problem = checkpoints.verify(ckpt)
    assert problem == (
        "global_step8/zero_pp_rank_0_mp_rank_00_optim_states.pt: its pickle names posix.system, which "
        "DeepSpeed's loader would run (it loads without weights_only)"
    )
    assert checkpoints.last_complete(folder) == folder / "checkpoint-4" and not pwned.exists()
    torch.save({"x": 1}, shard, _use_new_zipfile_serialization=False)  # the legacy format: not checkable
    _reseal(ckpt)
    assert "not in torch's zip format" in checkpoints.verify(ckpt)


def test_with_every_checkpoint_damaged_the_run_starts_over_saying_so(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    only = _checkpoint(folder, 4)
    (only / "trainer_state.json").write_text("{")
    _reseal(only)
    with caplog.at_level(logging.WARNING, logger="finetune.rundir.checkpoints"):
        assert checkpoints.resume_checkpoint(True, folder) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"damaged checkpoint {only} (trainer_state.json: not JSON): no complete checkpoint left: starting from step 0"
    ]
    with pytest.raises(ConfigError, match="no other complete checkpoint: resume=false starts over"):
        checkpoints.resume_checkpoint(str(only), folder)


def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoints", 4)
    manifest = json.loads((ckpt / checkpoints.MANIFEST).read_text())
    manifest["files"]["../../precious"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / checkpoints.MANIFEST).write_text(json.dumps(manifest))
    assert "outside the checkpoint" in checkpoints.verify(ckpt)


@pytest.mark.parametrize(
    "name, text, needle",
    [
        (rundir.PLAN_FILE, "{", "plan.json: damaged (JSONDecodeError"),
        (rundir.ENGINE_FILE, '{"engine": "ddp"}', "engine.json: damaged (ValueError: not an engine record)"),
        (rundir.CONFIG_FILE, "model: [unclosed", "config.yaml: damaged ("),
    ],
)
def test_a_damaged_run_dir_file_the_ranks_read_is_one_line(tmp_path, name, text, needle):
    run = tmp_path / "run"
    run.mkdir()
    (run / name).write_text(text)
    load = {rundir.PLAN_FILE: rundir.load_plan, rundir.ENGINE_FILE: rundir.load_engine}.get(
        name, rundir.load_config
    )
    with pytest.raises(LaunchError, match=re.escape(needle)) as err:
        load(run)
    assert "\n" not in str(err.value) and "write it again: python -m finetune" in str(err.value)


def test_a_checkpoint_that_fails_to_load_names_the_previous_one(tmp_path):
    from finetune.train.resume import unresumable

    folder = tmp_path / "checkpoints"
    _checkpoint(folder, 4)
    newest = _checkpoint(folder, 8)
    error = unresumable(
        newest, ValueError("loaded state dict has a different number of parameter groups\nmore")
    )
    assert str(error) == (
        f"checkpoint {newest} could not be resumed (ValueError: loaded state dict has a different number of "
        "parameter groups), before its first step; resume=checkpoint-4 resumes from the previous complete checkpoint"
    )
    assert "resume=false starts over" in str(unresumable(folder / "checkpoint-4", RuntimeError("x")))


# ---------------------------------------------------------------- through the real trainer


TWELVE_STEPS = ("train.warmup_ratio=0.0", "method.lora_dropout=0.1", "train.max_steps=12", "train.save_steps=4",
                "train.save_total_limit=3")  # fmt: skip


@pytest.mark.slow
def test_resuming_past_damaged_checkpoints_through_the_real_trainer(tmp_path, tiny_cache, tiny_data, caplog):
    """Checkpoint 12's trainer state is not JSON and checkpoint 8 carries a pickle payload in its RNG state,
    both resealed: the run resumes from checkpoint 4 and retraces 5-12 bit for bit; metrics.json damaged on
    the way is written anew. Then a checkpoint that verifies but does not fit the optimizer stops in one line
    naming the previous one."""
    import torch
    from helpers import adapter_weights, losses, train_run

    run = tmp_path / "run"

    def train(*extra: str) -> dict:
        cfg = tiny_cfg(*TWELVE_STEPS, *extra, run_dir=run)
        return train_run(cfg, tiny_data, n_eval=8, max_generate=2, micro_batch_size=2, grad_accum_steps=2)

    train()
    folder = rundir.checkpoint_dir(run)
    reference, reference_adapter = losses(folder / "checkpoint-12"), adapter_weights(run)
    pwned = tmp_path / "PWNED"
    (folder / "checkpoint-12" / "trainer_state.json").write_text("{")
    _payload(folder / "checkpoint-8" / "rng_state.pth", pwned)
    for step in (8, 12):
        _reseal(folder / f"checkpoint-{step}")
    (run / rundir.METRICS_FILE).write_text("{")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        again = train()
    assert again["train"]["resumed_from"] == str((folder / "checkpoint-4").resolve()) and not pwned.exists()
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert any(
        "checkpoint-12 (trainer_state.json: not JSON): resuming from checkpoint-4" in w for w in warned
    )
    assert any("checkpoint-8 (rng_state.pth cannot be read (UnpicklingError" in w for w in warned)
    assert losses(folder / "checkpoint-12") == reference
    resumed = adapter_weights(run)
    assert all(torch.equal(resumed[k], reference_adapter[k]) for k in reference_adapter)
    assert json.loads((run / rundir.METRICS_FILE).read_text())["train"]["steps"] == 12

    # Verifies (a readable optimizer state), but not this optimizer's: the trainer fails while loading it.
    ckpt = folder / "checkpoint-12"
    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")
    _reseal(ckpt)
    with pytest.raises(ConfigError) as stopped:
        train("train.max_steps=16")
    assert str(stopped.value).startswith(f"checkpoint {ckpt} could not be resumed (ValueError: ")
    assert str(stopped.value).endswith("resume=checkpoint-8 resumes from the previous complete checkpoint")
