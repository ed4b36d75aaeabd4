"""A run directory is the project's own, and it has one writer for the life of a run.

- nothing the project did not write is deleted (a user's data file in RUN_DIR/data survives the data stage);
- `/`, a home directory, the installed package and foreign non-empty folders are refused as run_dir;
- the training worker holds the run directory's lock itself (inherited from the pipeline) and dies
  with its parent: a kill -9 of the pipeline leaves no orphan writing on, and no second run starts
  while any writer lives.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import WORKER_RUN, child_env

from finetune import rundir


def _cli(args: list[str], capsys) -> tuple[int, str]:
    from finetune.pipeline.cli import main

    code = main(args)
    return code, capsys.readouterr().err


def _chats(path: Path, n: int = 40) -> Path:
    from finetune.data import synthetic

    convs = synthetic.conversations(n, seed=1, median_words=8)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path


# ---------------------------------------------------------------- item 1: never delete what is not ours


def test_data_stage_keeps_a_users_data_folder_inside_run_dir(tmp_path, tiny_cache, capsys):
    """run_dir=proj with proj/data/chats.jsonl: the file (and its folder) survive."""
    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    chats = _chats(proj / "data" / "chats.jsonl")
    (proj / "data" / "notes.txt").write_text("mine\n")
    before = {p.name: p.read_bytes() for p in (proj / "data").iterdir()}
    args = ["mode=data", f"run_dir={proj}", f"data.path={chats}", f"data.cache_dir={tmp_path / 'cache'}"]
    code, err = _cli(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"run_dir={proj}: an existing folder that is not a finetune run directory" in err
    assert {p.name: p.read_bytes() for p in (proj / "data").iterdir()} == before
    assert sorted(p.name for p in proj.iterdir()) == ["data"]  # nothing written: no config.yaml, no .lock


def test_a_users_files_in_run_dir_data_of_our_run_dir_survive(tmp_path, tiny_cache, capsys):
    """Our own run directory, but RUN_DIR/data was put there by the user: the stage stops, nothing is deleted."""
    run = tmp_path / "run"
    common = [f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=512"]
    assert _cli(["mode=plan", *common], capsys)[0] == 0
    assert (run / rundir.OWNER_FILE).is_file()
    (run / "data").mkdir()
    chats = _chats(run / "data" / "chats.jsonl")
    blob = chats.read_bytes()
    code, err = _cli(["mode=data", f"data.path={chats}", *common], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{run / 'data'}: exists and was not written by finetune" in err and "nothing was deleted" in err
    assert chats.read_bytes() == blob and sorted(p.name for p in (run / "data").iterdir()) == ["chats.jsonl"]
    # Moved out: the stage runs, and a second run replaces the folder it published itself.
    outside = tmp_path / "chats.jsonl"
    chats.rename(outside)
    (run / "data").rmdir()
    for _ in range(2):
        code, err = _cli(["mode=data", f"data.path={outside}", *common], capsys)
        assert code == 0, err
        assert (run / "data" / rundir.OWNER_FILE).is_file() and (run / "data" / "train").is_dir()


def test_publish_replaces_a_data_folder_published_before_the_marker(tmp_path):
    """RUN_DIR/data written by an older finetune (a copy of a cache entry, no marker) is still ours to replace."""
    from finetune.data import cache

    entry = tmp_path / "entry"
    for sub in ("train", "eval"):
        (entry / sub).mkdir(parents=True)
        (entry / sub / "rows").write_text(sub)
    (entry / cache.STATS_FILE).write_text("{}")
    cache.write_manifest(entry)
    old = tmp_path / "run" / "data"
    (old / "train").mkdir(parents=True)
    (old / "eval").mkdir()
    (old / cache.STATS_FILE).write_text('{"old": 1}')
    cache.publish(entry, old)
    assert (old / cache.STATS_FILE).read_text() == "{}" and (old / "train" / "rows").read_text() == "train"
    foreign = tmp_path / "run2" / "data"
    foreign.mkdir(parents=True)
    (foreign / "x.jsonl").write_text("{}\n")
    with pytest.raises(Exception, match="not written by finetune"):
        cache.publish(entry, foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["x.jsonl"]
    assert not [p for p in foreign.parent.iterdir() if p.name.startswith(".data.tmp")]  # no leftover copy


def _package_dir() -> Path:
    import finetune

    return Path(finetune.__file__).resolve().parent


@pytest.mark.parametrize(
    "where, needle",
    [
        ("/", "the root of the file system"),
        ("{home}", "a home directory"),
        ("{package}", "inside the installed finetune package"),
        ("{package}/data", "inside the installed finetune package"),
        ("{foreign}", "an existing folder that is not a finetune run directory"),
    ],
    ids=["root", "home", "package", "package_data", "foreign_non_empty"],
)
@pytest.mark.parametrize("mode", ["plan", "data"])
def test_run_dir_that_is_not_ours_is_refused_before_anything_is_written(
    tmp_path, tiny_cache, monkeypatch, capsys, where, needle, mode
):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    foreign = tmp_path / "proj"
    foreign.mkdir()
    (foreign / "report.txt").write_text("keep me\n")
    run = where.format(home=home, package=_package_dir(), foreign=foreign)

    def snapshot(folder: Path) -> set[str]:
        if folder == Path("/"):
            return set(os.listdir("/"))
        return {str(p) for p in folder.rglob("*") if "__pycache__" not in p.parts}

    watched = [Path(run), _package_dir()]
    before = [snapshot(p) if p.exists() else None for p in watched]
    code, err = _cli([f"mode={mode}", f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"run_dir={run}: {needle}" in err
    assert [snapshot(p) if p.exists() else None for p in watched] == before


def test_empty_or_new_folders_become_run_dirs_and_keep_working(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for run in (empty, tmp_path / "new" / "run"):
        assert _cli(["mode=plan", f"run_dir={run}"], capsys)[0] == 0
        assert (run / rundir.OWNER_FILE).is_file() and (run / "plan.json").is_file()
        assert _cli(["mode=plan", f"run_dir={run}"], capsys)[0] == 0  # ours now, with files in it
    legacy = tmp_path / "legacy"  # written before the marker existed: config.yaml next to .lock
    legacy.mkdir()
    (legacy / "config.yaml").write_text("name: tiny\n")
    (legacy / ".lock").write_text("")
    assert _cli(["mode=plan", f"run_dir={legacy}"], capsys)[0] == 0
    assert (legacy / rundir.OWNER_FILE).is_file()


def test_name_cannot_leave_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name, value in [("../../x",) * 2, ("a/b",) * 2, ("..",) * 2, ("a\ntouch x\n#", "'a\ntouch x\n#'")]:
        code, err = _cli(["mode=plan", f"name={value}"], capsys)
        assert code == 2 and f"name={name!r}: use letters, digits" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert not (tmp_path.parent.parent / "x").exists()
    assert _cli(["mode=plan", "name=my-run_1.2"], capsys)[0] == 0
    assert (tmp_path / "runs" / "my-run_1.2" / "plan.json").is_file()


# ---------------------------------------------------------------- item 2: one lock holder for the life of a run

# A pipeline stand-in: takes the lock as `python -m finetune` does, then starts a child with the real
# process runner (lock inherited, dies with its parent) and waits for it.
PARENT = """
import sys
from pathlib import Path
from finetune import rundir
from finetune.launch.runner import subprocess_runner
run = Path(sys.argv[1])
rundir.lock(run)
sys.exit(subprocess_runner([sys.executable, "-c", sys.argv[2], str(run)], {}, str(run)))
"""

# The training worker's part: takes the lock (inherited), says so, then works until stopped.
CHILD = """
import os, signal, sys, time
from pathlib import Path
from finetune import rundir
run = Path(sys.argv[1])
rundir.lock(run)
{on_term}
(run / "child.pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def _start_parent(run: Path, on_term: str) -> subprocess.Popen:
    child = CHILD.format(on_term=on_term)
    return subprocess.Popen([sys.executable, "-c", PARENT, str(run), child], env=child_env(), cwd=run)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text().strip()):
        assert proc.poll() is None, f"parent ended with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, timeout: float) -> bool:
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _try_lock(run: Path) -> subprocess.CompletedProcess:
    code = "import sys; from pathlib import Path; from finetune import rundir; rundir.lock(Path(sys.argv[1]))"
    return subprocess.run(
        [sys.executable, "-c", code, str(run)], env=child_env(), capture_output=True, text=True, timeout=60
    )


def test_kill_9_of_the_parent_stops_the_worker(tmp_path):
    """PR_SET_PDEATHSIG: the worker gets SIGTERM when its parent dies, and ends; the lock is then free."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    parent = _start_parent(tmp_path, on_term="")
    child = _wait_for(tmp_path / "child.pid", parent)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        assert _gone(child, timeout=10), "the worker outlived its parent"
    finally:
        _kill(child)
    assert _try_lock(tmp_path).returncode == 0


def _kill(pid: int) -> None:
    """End a test's own child process if it is still there (a failing test leaves no orphan behind)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_a_worker_that_outlives_its_parent_still_holds_the_lock(tmp_path):
    """A worker still saving after its parent died (it ignores SIGTERM here) keeps the run directory:
    a second run is refused, naming the living worker, until it ends."""
    parent = _start_parent(tmp_path, on_term="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    child = _wait_for(tmp_path / "child.pid", parent)
    holders = (tmp_path / rundir.LOCK_FILE).read_text().split()
    assert holders[0] == str(parent.pid) and str(child) in holders
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    time.sleep(0.3)
    try:
        second = _try_lock(tmp_path)
        assert second.returncode != 0 and f"in use by pid {child} on " in second.stderr, second.stderr
        assert f"pid {parent.pid}" not in second.stderr.splitlines()[-1]  # the dead parent is not named
    finally:
        _kill(child)
    assert _gone(child, timeout=10)
    time.sleep(0.1)
    assert _try_lock(tmp_path).returncode == 0


@pytest.mark.slow
def test_kill_9_of_mode_train_leaves_no_orphan_and_the_rerun_resumes(tmp_path, tiny_cache):
    """End to end: kill -9 the pipeline of a running mode=train; the worker saves and
    ends (no orphan writing on), the same command resumes from its checkpoint and finishes."""
    run = tmp_path / "run"
    args = [
        sys.executable, "-m", "finetune", "mode=train", f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}",
        *WORKER_RUN, "train.max_steps=400", "train.save_steps=5", "train.loss_spike_factor=0",
    ]  # fmt: skip
    assert subprocess.run([*args[:3], "mode=data", *args[4:]], env=child_env(), timeout=600).returncode == 0
    log = tmp_path / "pipeline.log"
    with open(log, "w") as out:
        pipeline = subprocess.Popen(args, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "checkpoint-5").is_dir():
        assert pipeline.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    import psutil

    [worker] = psutil.Process(pipeline.pid).children()
    pipeline.send_signal(signal.SIGKILL)
    pipeline.wait()
    assert _gone(worker.pid, timeout=60), "the worker went on training after its parent died"
    from finetune.rundir import checkpoints

    last = checkpoints.last_complete(run / "checkpoints")
    assert last is not None and checkpoints.step_of(last) >= 5
    rerun = subprocess.run(
        [*args[:-3], "train.max_steps=" + str(checkpoints.step_of(last) + 5), *args[-2:]],
        env=child_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["train"]["resumed_from"] == str(last.resolve())
