"""Every file a user names is read through the one bounded reader (finetune/core/userfiles.py), and every user
function runs under a time limit the user sets: a device, a FIFO or an oversized file named in
`model.config_path`, a YAML config file, an lm-eval task file or an adapter's own files is one line (exit 2 on
the command line), never a hang, a traceback or memory read without end."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers import make_adapter_run, tiny_cfg

from finetune.core import metrics
from finetune.core.config.evaluation import EvalConfig
from finetune.core.errors import ConfigError, LaunchError
from finetune.modeling import outputs, resolve

REFUSAL = "not a file; refusing to read it (it could block or never end): name a regular file"


def _cli(args: list[str], capsys) -> tuple[int, str]:
    """`python -m finetune ARGS` in this process: (exit code, its one line on stderr)."""
    from finetune.pipeline.cli import main

    code = main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "named.fifo"
    os.mkfifo(path)
    return path


def _sparse(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        f.truncate(size)  # claimed, nothing written
    return path


# ---------------------------------------------------------------- model.config_path


@pytest.mark.parametrize("kind", ["dev_zero", "fifo"])
def test_config_path_naming_a_device_or_fifo_is_one_line(tmp_path, fifo, capsys, kind):
    path, what = {"dev_zero": ("/dev/zero", "a character device"), "fifo": (fifo, "a FIFO (named pipe)")}[
        kind
    ]
    start = time.monotonic()
    code, line = _cli(["mode=plan", f"run_dir={tmp_path / 'run'}", f"model.config_path={path}"], capsys)
    assert time.monotonic() - start < 30  # neither read /dev/zero nor waited on the FIFO
    assert code == 2
    assert line.endswith(f"model.config_path={path}: is {what}, {REFUSAL}")


def test_an_oversized_config_json_is_refused_before_reading(tmp_path, capsys):
    big = _sparse(tmp_path / "config.json", resolve.CONFIG_JSON_LIMIT + 1)
    code, line = _cli(["mode=plan", f"run_dir={tmp_path / 'run'}", f"model.config_path={big}"], capsys)
    assert code == 2
    assert line.endswith(
        f"model.config_path={big}: 16.8 MB, more than the 16.8 MB such a file may hold; is it the right file?"
    )
    # the same file within the bound is read as before
    with pytest.raises(ConfigError, match=r"config.json: not a readable JSON file"):
        resolve.read_config_json(_sparse(tmp_path / "small.json", 100), f"model.config_path={big}")


# ---------------------------------------------------------------- the other files a user names


def test_a_yaml_config_file_that_is_a_fifo_or_oversized_is_one_line(tmp_path, fifo, capsys):
    code, line = _cli(["mode=plan", f"+recipe={fifo}"], capsys)
    assert code == 2 and line.endswith(f"+recipe={fifo}: is a FIFO (named pipe), {REFUSAL}")
    big = _sparse(tmp_path / "mine.yaml", 100 << 20)
    code, line = _cli(["mode=plan", str(big)], capsys)
    assert code == 2
    assert line.endswith(
        f"+recipe={big}: 104.9 MB, more than the 67.1 MB such a file may hold; is it the right file?"
    )


def test_an_lm_eval_task_file_that_is_a_fifo_or_device_is_one_line(tmp_path, fifo):
    from finetune.evaluation import lm_eval

    link = tmp_path / "task.yaml"
    link.symlink_to("/dev/zero")
    for path, what in (
        (link, "a character device"),
        (fifo.rename(tmp_path / "fifo.yaml"), "a FIFO (named pipe)"),
    ):
        with pytest.raises(ConfigError) as err:
            lm_eval._tasks(EvalConfig(lm_eval_tasks=[str(path)]))
        assert str(err.value) == f"eval.lm_eval_tasks={path}: is {what}, {REFUSAL}"
    good = tmp_path / "mine.yaml"
    good.write_text("task: my_task\n")
    assert lm_eval._tasks(EvalConfig(lm_eval_tasks=[str(good)])) == (["my_task"], [str(tmp_path)])


@pytest.fixture
def adapter(tmp_path, tiny_cache, tiny_model_cfg) -> Path:
    run = tmp_path / "run"
    folder = make_adapter_run(run, tiny_model_cfg, tiny_cfg(f"run_dir={run}").method)
    outputs.record(folder, 4, "r1", "adapter")
    return folder


def test_an_identity_file_naming_a_device_or_a_path_outside_is_refused(adapter):
    identity = adapter / outputs.IDENTITY_FILE
    doc = json.loads(identity.read_text())
    for name in ("/dev/zero", "../adapter/adapter_model.safetensors"):
        identity.write_text(json.dumps({**doc, "files": {name: "0" * 64}}))
        start = time.monotonic()
        with pytest.raises(LaunchError) as err:
            outputs.check_adapter(adapter)
        assert time.monotonic() - start < 10  # /dev/zero was never hashed
        assert str(err.value) == f"{identity}: names {name!r}, not a file of {adapter}; train it again"
    # a recorded file of the folder swapped for a FIFO: refused, not waited on
    identity.write_text(json.dumps(doc))
    tokenizer_file = next(name for name in doc["files"] if name != outputs.ADAPTER_WEIGHTS)
    (adapter / tokenizer_file).unlink()
    os.mkfifo(adapter / tokenizer_file)
    with pytest.raises(LaunchError) as err:
        outputs.check_adapter(adapter)
    assert str(err.value) == f"adapter={adapter / tokenizer_file}: is a FIFO (named pipe), {REFUSAL}"


def test_an_oversized_adapter_config_is_refused_before_reading(adapter):
    (adapter / outputs.IDENTITY_FILE).unlink()
    config = _sparse(adapter / "adapter_config.json", (16 << 20) + 1)
    with pytest.raises(LaunchError) as err:
        outputs.check_adapter(adapter)
    assert str(err.value) == (
        f"adapter={config}: 16.8 MB, more than the 16.8 MB such a file may hold; is it the right file?"
    )


# ---------------------------------------------------------------- eval.metric_timeout_s


def test_the_metric_time_limit_is_a_checked_setting(tmp_path, capsys):
    assert EvalConfig().metric_timeout_s == 600.0
    assert tiny_cfg("eval.metric_timeout_s=2.5").eval.metric_timeout_s == 2.5
    for bad, why in (("0", "must be > 0"), ("-1", "must be > 0"), ("nan", "must be a finite number")):
        code, line = _cli(
            ["mode=plan", f"run_dir={tmp_path / 'run'}", f"eval.metric_timeout_s={bad}"], capsys
        )
        assert code == 2 and "eval.metric_timeout_s=" in line and line.endswith(why), line


def test_a_user_metric_past_the_setting_is_one_line_naming_it(tmp_path, monkeypatch):
    (tmp_path / "slow_metrics.py").write_text(
        "import time\n\ndef slow(prompts, predictions, references):\n    time.sleep(30)\n    return 1.0\n"
    )
    (tmp_path / "slow_import.py").write_text(
        "import time\ntime.sleep(30)\n\ndef fn(p, q, r):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (metric,) = metrics.resolve(["slow_metrics.slow"], timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        metric(["p"], ["a"], ["a"])
    assert time.monotonic() - start < 5
    assert str(err.value) == (
        "metric 'slow_metrics.slow' did not return within 0.2 s (eval.metric_timeout_s); fix it, or raise "
        "eval.metric_timeout_s if it is only slow"
    )
    # importing the metric's module is held to the same setting
    with pytest.raises(ConfigError) as err:
        metrics.resolve(["slow_import.fn"], timeout_s=0.2)
    assert str(err.value) == (
        "importing 'slow_import' (eval.metrics) did not return within 0.2 s (eval.metric_timeout_s); fix it, "
        "or raise eval.metric_timeout_s if it is only slow"
    )


# ---------------------------------------------------------------- a checkpoint named by resume=PATH


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "oversized"])
def test_a_checkpoint_manifest_that_is_no_regular_file_is_an_incomplete_checkpoint(tmp_path, kind):
    from finetune.rundir import checkpoints

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    manifest = folder / checkpoints.MANIFEST
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "dev_zero":
        manifest.symlink_to("/dev/zero")
    else:
        _sparse(manifest, (16 << 20) + 1)
    start = time.monotonic()
    why = checkpoints.verify(folder)
    assert time.monotonic() - start < 5  # neither waited on the FIFO nor read /dev/zero
    assert (
        why
        == {
            "fifo": f"unreadable manifest.json (is a FIFO (named pipe), {REFUSAL})",
            "dev_zero": f"unreadable manifest.json (is a character device, {REFUSAL})",
            "oversized": "unreadable manifest.json (16.8 MB, more than the 16.8 MB such a file may hold; is it "
            "the right file?)",
        }[kind]
    )
