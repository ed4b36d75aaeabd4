"""Security: no secret in any file of a real run or its output, one writer per run directory, safe loading."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from finetune import secrets
from finetune.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent

PLANTED = {
    "HF_TOKEN": "hf_plantedTokenAAAA1111",
    "WANDB_API_KEY": "wandb_plantedKeyBBBB2222",
    "MY_SERVICE_TOKEN": "svc_plantedCCCC3333",
    "AWS_SECRET_ACCESS_KEY": "aws/plantedDDDD4444",
    "DB_PASSWORD": "pw_plantedEEEE5555",
    "CI_DEPLOY_SECRET": "dep_plantedFFFF6666",
}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_scrub_names_values_and_keys():
    env = {"HF_TOKEN": "hf_abcdefgh123", "PATH": "/usr/bin", "SHORT_TOKEN": "1", "X_API_KEY": "k" * 20}
    assert secrets.secret_values(env) == {"k" * 20: "X_API_KEY", "hf_abcdefgh123": "HF_TOKEN"}
    assert (
        secrets.scrub_text("url https://u:hf_abcdefgh123@host", env)
        == "url https://u:<redacted:HF_TOKEN>@host"
    )
    assert secrets.scrub_text("export T=hf_abcdefgh123", env, shell=True) == "export T=${HF_TOKEN}"
    data = {"env": {"GH_TOKEN": "ghp_x", "PLAIN": "hf_abcdefgh123", "N": 3}, "list": ["1", "hf_abcdefgh123"]}
    assert secrets.scrub(data, env) == {
        "env": {"GH_TOKEN": "<redacted:GH_TOKEN>", "PLAIN": "<redacted:HF_TOKEN>", "N": 3},
        "list": ["1", "<redacted:HF_TOKEN>"],
    }
    for name in ("HF_TOKEN", "WANDB_API_KEY", "github_token", "OPENAI_API_KEY", "DB_PASSWORD", "X_SECRET"):
        assert secrets.is_secret_name(name)
    for name in ("PATH", "HOME", "TOKENIZERS_PARALLELISM", "KEYBOARD"):
        assert not secrets.is_secret_name(name)


def test_log_records_are_scrubbed(monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", PLANTED["HF_TOKEN"])
    secrets.install_log_filter()
    with caplog.at_level(logging.INFO):
        logging.getLogger("finetune.test").info("loading with token %s", PLANTED["HF_TOKEN"])
    assert PLANTED["HF_TOKEN"] not in caplog.text and "<redacted:HF_TOKEN>" in caplog.text


@pytest.mark.slow
def test_planted_secrets_appear_in_no_file_and_no_output(tmp_path, tiny_cache):
    """data, plan, train (tensorboard on) and a launch script with secrets in the environment and in overrides."""
    env = _env(**PLANTED)
    run = tmp_path / "run"
    common = [
        f"run_dir={run}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.seq_len=128",
        "train.max_steps=4",
        "train.save_steps=2",
        "train.logging_steps=1",
        "train.report_to=[tensorboard]",
        "data.eval_fraction=0.01",
        "+launch.env.HF_TOKEN=${oc.env:HF_TOKEN}",  # forwarding a token to the ranks, as one would
        "+launch.env.DEPLOY=${oc.env:CI_DEPLOY_SECRET}",
    ]
    outputs = []
    for mode in ("data", "plan"):
        r = _run([sys.executable, "-m", "finetune", f"mode={mode}", *common], env, tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        outputs.append(r.stdout + r.stderr)
    r = _run([sys.executable, "-m", "finetune.train", str(run)], env, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    outputs.append(r.stdout + r.stderr)
    r = _run([sys.executable, "-m", "finetune", "mode=launch", "launch.dry_run=true", *common], env, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"config.yaml", "plan.json", "metrics.json", "data_stats.json", "launch.sh"} <= {
        p.name for p in files
    }
    assert any(p.name.startswith("events.out.tfevents") for p in files)
    assert any(p.name == "trainer_state.json" for p in files)
    for path in files:
        blob = path.read_bytes()
        for name, value in PLANTED.items():
            assert value.encode() not in blob, f"{name} leaked into {path.relative_to(tmp_path)}"
    for text in outputs:
        for name, value in PLANTED.items():
            assert value not in text, f"{name} leaked into the output"
    config = (run / "config.yaml").read_text()
    assert "HF_TOKEN: <redacted:HF_TOKEN>" in config and "DEPLOY: <redacted:CI_DEPLOY_SECRET>" in config
    script = (run / "launch.sh").read_text()
    assert "export HF_TOKEN=${HF_TOKEN}" in script  # read from the environment that runs the script
    assert subprocess.run(["bash", "-n", str(run / "launch.sh")]).returncode == 0


def test_launch_does_not_print_secret_values(tmp_path):
    env = _env(HF_TOKEN=PLANTED["HF_TOKEN"])
    r = _run(
        [
            sys.executable, "-m", "finetune", "mode=launch", "launch.dry_run=true",
            "+recipe=llama8b_lora", f"run_dir={tmp_path / 'run'}", "+launch.env.HF_TOKEN=${oc.env:HF_TOKEN}",
        ],
        env,
        tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert PLANTED["HF_TOKEN"] not in r.stdout + r.stderr


# ---------------------------------------------------------------- one writer per run directory


def test_second_run_on_a_locked_run_dir_exits_2_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from finetune import rundir; "
            "rundir.lock(Path(sys.argv[1])); print('locked', flush=True); time.sleep(300)",
            str(run),
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = _run([sys.executable, "-m", "finetune", "mode=plan", f"run_dir={run}"], _env(), tmp_path)
        assert r.returncode == 2
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
        assert f"run_dir={run}: in use by pid {holder.pid}" in r.stderr
        assert not (run / "config.yaml").exists() and not (run / "plan.json").exists()  # nothing written
        w = _run([sys.executable, "-m", "finetune.train", str(run)], _env(), tmp_path)
        assert w.returncode == 2 and f"in use by pid {holder.pid}" in w.stderr and "Traceback" not in w.stderr
    finally:
        holder.send_signal(signal.SIGKILL)  # a crashed holder: the kernel drops its lock
        holder.wait()
        holder.stdout.close()
    time.sleep(0.1)
    r = _run([sys.executable, "-m", "finetune", "mode=plan", f"run_dir={run}"], _env(), tmp_path)
    assert r.returncode == 0, r.stderr
    assert (run / "plan.json").is_file()


def test_lock_is_reentrant_and_covers_children(tmp_path):
    """The process that holds the lock (the pipeline) may launch the training worker under it."""
    from finetune import rundir

    rundir.lock(tmp_path)
    rundir.lock(tmp_path)  # again in the same process: fine
    child = _run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from finetune import rundir; "
         "rundir.lock(Path(sys.argv[1])); print('ok')", str(tmp_path)],
        _env(),
        tmp_path,
    )  # fmt: skip
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr


# ---------------------------------------------------------------- loading: no code runs unless asked


def test_pickle_weights_refused_unless_allowed_and_opt_ins_logged(tmp_path, tiny_cache, caplog):
    import torch

    from finetune import tiny
    from finetune.cli import compose
    from finetune.train.models import check_weight_safety, load_for_training

    cfg = compose(["train.seq_len=128"])
    assert cfg.model.trust_remote_code is False and cfg.model.allow_pickle_weights is False
    model = tiny.load_model(cfg.model)
    folder = tmp_path / "pickled"
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    pickled = replace(cfg, model=replace(cfg.model, name="pickled", config_path=str(folder / "config.json")))
    with pytest.raises(
        ConfigError, match=r"only pickle weights \(pytorch_model.bin\).*allow_pickle_weights=true"
    ):
        load_for_training(pickled)
    allowed = replace(pickled, model=replace(pickled.model, allow_pickle_weights=True))
    with caplog.at_level(logging.WARNING):
        loaded, _ = load_for_training(allowed)
    assert "allow_pickle_weights=true" in caplog.text and loaded is not None
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_weight_safety(replace(cfg.model, trust_remote_code=True), str(tiny.model_dir(cfg.model)))
    assert "trust_remote_code=true" in caplog.text
