"""train.report_to: what MLflow and W&B receive from a run, read back through their own clients."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import SEQ_LEN, child_env, run_cli, tiny_cfg

from finetune.core.errors import ConfigError
from finetune.evaluation.curves import log_history, loss_series
from finetune.train import tracking

# A short default job: four logged steps, a few held-out prompts, no regression set.
TINY_JOB = (
    SEQ_LEN,
    "train.max_steps=4",
    "train.logging_steps=1",
    "train.eval_steps=1000",
    "train.save_steps=1000",
    "eval.num_samples=4",
    "eval.max_new_tokens=4",
    "eval.regression=false",
    "eval.progress=false",
)
# Secrets in the environment of the run: none may reach the run directory.
SECRETS = {"WANDB_API_KEY": "wandb-secret-0123456789", "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-0123456789"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """An MLflow tracking server on 127.0.0.1 (a free port), its own SQLite store and artifact folder in tmp;
    stopped (its whole process group) after the test."""
    pytest.importorskip("mlflow")
    port = free_port()
    store = tmp_path / "mlflow-server"
    store.mkdir()
    log = (store / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--artifacts-destination", str(store / "artifacts")],
        cwd=store, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((store / "server.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def files_holding(folder: Path, needles: list[str]) -> list[str]:
    """Files under `folder` whose bytes contain any of `needles`."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [f"{path}: {n}" for n in needles if n.encode() in data]
    return found


def test_unknown_tracker_and_missing_package_are_one_line(monkeypatch):
    with pytest.raises(
        ConfigError, match=r"train.report_to: unknown tracker 'neptune' \(choose from tensorboard"
    ):
        tiny_cfg("train.report_to=[neptune]")
    cfg = tiny_cfg("train.report_to=[mlflow]")
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ConfigError, match=r"train.report_to=\[mlflow\] needs the mlflow package: pip install"
    ):
        tracking.check_installed(cfg)


def test_tracking_uri_is_written_without_credentials():
    assert (
        tracking.without_credentials("https://me:pw@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    )
    assert tracking.without_credentials("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert tracking.without_credentials("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"


@pytest.mark.slow
def test_default_job_with_mlflow_and_gguf(tmp_path, tiny_cache, mlflow_server):
    """The default job with train.report_to=[mlflow] and export.gguf=q8_0 against a local tracking server: one
    MLflow run holds the resolved config and the plan, the loss of every step (transformers' callback), the
    evaluation's scores and plan.json / report.md / the model card, byte for byte; export/gguf holds the q8_0
    file (read back with the gguf reader) and its Modelfile; no secret of the environment is in the run
    directory."""
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    env = child_env(MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME="finetune-test", **SECRETS)
    args = [f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", *TINY_JOB, "train.report_to=[mlflow]",
            "export.gguf=q8_0"]  # fmt: skip
    proc = run_cli(*args, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    record = json.loads((run / "tracking.json").read_text())["mlflow"]
    assert record["tracking_uri"] == mlflow_server and record["experiment"] == "finetune-test"
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([record["experiment_id"]])
    assert [r.info.run_id for r in runs] == [record["run_id"]]  # training and evaluation: one run
    mlrun = runs[0]
    assert mlrun.info.status == "FINISHED"

    params = mlrun.data.params
    plan = json.loads((run / "plan.json").read_text())
    assert params["train.max_steps"] == "4" and params["model.name"] == "tiny"
    assert params["train.report_to"] == '["mlflow"]'
    assert params["plan.gpu_memory_gb"] == str(plan["gpu_memory_gb"]["total"])
    assert params["plan.strategy.micro_batch_size"] == str(plan["strategy"]["micro_batch_size"])
    assert params["plan.params.total"] == str(plan["params"]["total"])
    # TrainingArguments, logged by transformers' own callback to the same run
    assert float(params["learning_rate"]) == float(params["method.learning_rate"])

    # The loss of each of the four steps, as the trainer logged it (its own log in the run directory).
    expected = dict(loss_series(log_history(run))["train"])
    history = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "loss")}
    assert sorted(history) == [1, 2, 3, 4] and history == pytest.approx(expected, rel=1e-6)

    scores = json.loads((run / "eval" / "metrics.json").read_text())
    metrics = mlrun.data.metrics
    for variant in ("base", "trained", "merged"):
        assert metrics[f"eval.{variant}.loss"] == pytest.approx(scores[variant]["loss"])
        assert metrics[f"eval.{variant}.exact_match"] == pytest.approx(scores[variant]["exact_match"])

    out = tmp_path / "downloaded"
    for name in ("plan.json", "config.yaml", "eval/report.md", "eval/metrics.json", "export/README.md"):
        got = Path(client.download_artifacts(mlrun.info.run_id, name, str(out)))
        assert got.read_bytes() == (run / name).read_bytes(), name

    # What export.gguf=q8_0 wrote: the file llama.cpp's converter made, its Modelfile, export.json's entry.
    from gguf import GGUFReader

    exported = json.loads((run / "export" / "export.json").read_text())["gguf"]
    assert exported["path"] == "tiny.q8_0.gguf" and exported["type"] == "q8_0"
    reader = GGUFReader(str(run / "export" / "gguf" / "tiny.q8_0.gguf"))
    chat_template = (run / "export" / "merged" / "chat_template.jinja").read_text()
    assert reader.fields["tokenizer.chat_template"].contents() == chat_template
    assert reader.fields["general.file_type"].contents() == 7  # llama.cpp's MOSTLY_Q8_0
    modelfile = (run / "export" / "gguf" / "Modelfile").read_text().splitlines()
    assert modelfile[0] == "FROM ./tiny.q8_0.gguf" and modelfile[-1] == 'PARAMETER stop "<|end|>"'
    card = (run / "export" / "README.md").read_text()
    merged = scores["merged"]
    assert (
        f"| merged | {merged['loss']:.4f} |" in card and "tags:\n- finetune\n- lora\n- sft\n- gguf\n" in card
    )

    assert files_holding(run, list(SECRETS.values())) == []


@pytest.mark.slow
def test_wandb_offline_run_files(tmp_path, tiny_cache):
    """train.report_to=[wandb] under WANDB_MODE=offline: the offline run lands in RUN_DIR/wandb, its history
    holds the loss of every step, and the API key of the environment is written nowhere in the run."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    env = child_env(WANDB_MODE="offline", WANDB_SILENT="true", **SECRETS)
    args = [f"run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", *TINY_JOB, "train.report_to=[wandb]"]
    for mode in ("data", "train"):
        proc = run_cli(f"mode={mode}", *args, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run / "wandb").iterdir())
    (wandb_file,) = offline[0].glob("run-*.wandb")
    run_record, losses = wandb_losses(wandb_file)
    assert (run_record.project, run_record.display_name) == ("finetune", tiny_cfg().name)
    expected = [loss for _, loss in loss_series(log_history(run))["train"]]
    assert losses == pytest.approx(expected, rel=1e-6)
    assert files_holding(run, list(SECRETS.values())) == []


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B run file (run-ID.wandb): a 7-byte header (":W&B", magic, version), then
    LevelDB's log format (32 KiB blocks of records with a 7-byte header: crc, length, full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the zero padding at a block's end
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_losses(path: Path) -> tuple[Any, list[float]]:
    """The run record and the `train/loss` of each history record of a W&B offline run file."""
    run, losses = None, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "train/loss" in items:
                losses.append(float(json.loads(items["train/loss"])))
    return run, losses
