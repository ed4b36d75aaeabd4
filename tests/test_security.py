"""Security: no secret in any file of a real run or its output, one writer per run directory, safe loading."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import SEQ_LEN, Capture, child_env, planned, planned_run_dir, run_cli

from finetune.core import secrets
from finetune.core.errors import ConfigError

PLANTED = {
    "HF_TOKEN": "hf_plantedTokenAAAA1111",
    "WANDB_API_KEY": "wandb_plantedKeyBBBB2222",
    "MY_SERVICE_TOKEN": "svc_plantedCCCC3333",
    "AWS_SECRET_ACCESS_KEY": "aws/plantedDDDD4444",
    "DB_PASSWORD": "pw_plantedEEEE5555",
    "CI_DEPLOY_SECRET": "dep_plantedFFFF6666",
}


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
    env = child_env(**PLANTED)
    run = tmp_path / "run"
    common = [
        f"run_dir={run}",
        f"data.cache_dir={tmp_path / 'cache'}",
        SEQ_LEN,
        "train.max_steps=4",
        "train.save_steps=2",
        "train.logging_steps=1",
        "train.report_to=[tensorboard]",
        "data.eval_fraction=0.01",
        "+launch.env.HF_TOKEN=${oc.env:HF_TOKEN}",  # forwarding a token to the ranks, as one would
        "+launch.env.DEPLOY=${oc.env:CI_DEPLOY_SECRET}",
    ]
    outputs = []
    # data, then plan + a launch dry run (launch.sh, engine.json: what the worker reads), then the worker itself
    for mode in (["mode=data"], ["mode=launch", "launch.dry_run=true"]):
        r = run_cli(*mode, *common, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        outputs.append(r.stdout + r.stderr)
    r = run_cli(str(run), module="finetune.train", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    outputs.append(r.stdout + r.stderr)

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"config.yaml", "plan.json", "engine.json", "metrics.json", "data_stats.json", "launch.sh"} <= {
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
    env = child_env(HF_TOKEN=PLANTED["HF_TOKEN"])
    r = run_cli(
        "mode=launch", "launch.dry_run=true", "+recipe=llama8b_lora", f"run_dir={tmp_path / 'run'}",
        "+launch.env.HF_TOKEN=${oc.env:HF_TOKEN}",
        env=env, cwd=tmp_path,
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
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = run_cli("mode=plan", f"run_dir={run}", env=child_env(), cwd=tmp_path)
        assert r.returncode == 2
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
        assert f"run_dir={run}: in use by pid {holder.pid}" in r.stderr
        assert not (run / "config.yaml").exists() and not (run / "plan.json").exists()  # nothing written
        w = run_cli(str(run), module="finetune.train", env=child_env(), cwd=tmp_path)
        assert w.returncode == 2 and f"in use by pid {holder.pid}" in w.stderr and "Traceback" not in w.stderr
    finally:
        holder.send_signal(signal.SIGKILL)  # a crashed holder: the kernel drops its lock
        holder.wait()
        holder.stdout.close()
    time.sleep(0.1)
    r = run_cli("mode=plan", f"run_dir={run}", env=child_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (run / "plan.json").is_file()


def test_lock_is_reentrant_and_covers_children(tmp_path):
    """The process that holds the lock (the pipeline) may launch the training worker under it."""
    from finetune import rundir

    rundir.lock(tmp_path)
    rundir.lock(tmp_path)  # again in the same process: fine
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from finetune import rundir; "
         "rundir.lock(Path(sys.argv[1])); print('ok')", str(tmp_path)],
        env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr


# ---------------------------------------------------------------- loading: no code runs unless asked


def test_pickle_weights_refused_unless_allowed_and_opt_ins_logged(tmp_path, tiny_cache, caplog):
    import torch

    from finetune.modeling import tiny
    from finetune.modeling.loading import check_weight_safety, load_for_training
    from finetune.pipeline.cli import compose

    cfg = compose([SEQ_LEN])
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


def test_every_loading_path_refuses_pickle_only_weights(tmp_path, tiny_cache):
    """Evaluation's base, trained and merged models and export's trained model go through the same check as
    training (finetune/modeling/models.py `load_pretrained`), not only the training path."""
    import torch

    from finetune import rundir
    from finetune.export.merge import merged_model
    from finetune.modeling import tiny, variants
    from finetune.pipeline.cli import compose

    def pickled(folder: Path) -> None:
        model = tiny.load_model(cfg.model)
        model.save_pretrained(folder)
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")

    cfg = compose([SEQ_LEN, "method=full"])
    base = tmp_path / "base"
    pickled(base)
    on_pickles = replace(cfg, model=replace(cfg.model, name="pickled", config_path=str(base / "config.json")))
    refused = r"only pickle weights \(pytorch_model.bin\)"
    with pytest.raises(ConfigError, match=refused):
        variants.load_variant(on_pickles, tmp_path / "run", "base")
    run = tmp_path / "run"
    pickled(rundir.trained_dir(run, uses_adapters=False))
    pickled(rundir.merged_dir(run))
    for variant in ("trained", "merged"):
        with pytest.raises(ConfigError, match=refused):
            variants.load_variant(cfg, run, variant)
    with pytest.raises(ConfigError, match=refused):
        merged_model(cfg, run, [])
    with pytest.raises(ConfigError, match=refused):
        variants.load_base(on_pickles, torch.float32)


# ---------------------------------------------------------------- scripts: every value quoted, secrets by name


def _launch(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(
        "mode=launch", "launch.dry_run=true", f"run_dir={tmp_path / 'run'}", *overrides,
        env=env or child_env(), cwd=tmp_path,
    )  # fmt: skip


def test_a_name_that_would_inject_a_command_is_refused_and_nothing_runs(tmp_path):
    """name='a<newline>touch FILE<newline>#' would put a command line into launch.sh: refused in one line, nothing
    written and nothing run."""
    target = tmp_path / "pwned"
    r = _launch(tmp_path, f"name='a\ntouch {target}\n#'")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "name=" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists() and not target.exists()


def _fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in interpreter that records its argv and the environment variables the script exported."""
    record = tmp_path / "argv.txt"
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'{{ printf "%s\\n" "$@"; printf "EXTRA=%s\\n" "$EXTRA"; printf "HF=%s\\n" "${{HF_TOKEN:-}}"; }} > {record}\n'
    )
    fake.chmod(0o755)
    return fake, record


def test_launch_sh_quotes_every_value_and_runs_none_of_them(tmp_path):
    """Hostile values in the environment, the interpreter path and the run directory reach the worker
    literally when launch.sh runs, and no command inside them runs."""
    target = tmp_path / "pwned"
    hostile = f'$(touch {target}); `touch {target}` "d" $HOME\n touch {target} ;'
    fake, record = _fake_python(tmp_path)
    run = tmp_path / "run $(touch pwned) `touch pwned`"
    r = run_cli(
        "mode=launch", "launch.dry_run=true", f"run_dir='{run}'", f"launch.python={fake}",
        f"+launch.env.EXTRA='{hostile}'",
        env=child_env(), cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    script = run / "launch.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not target.exists() and not (tmp_path / "pwned").exists()
    lines = record.read_text().split("\n")
    assert lines[:3] == ["-m", "finetune.train", str(run.resolve())]
    assert "\n".join(lines[3:]).startswith(f"EXTRA={hostile}\n")
    assert stat.S_IMODE(script.stat().st_mode) == 0o755  # no secret in it


def test_a_secret_given_on_the_command_line_is_referenced_by_name_only(tmp_path):
    """'+launch.env.HF_TOKEN=hf_...': launch.sh (mode 700) reads it from the environment at run time, and no file
    of the run directory and no output holds the token."""
    token = "hf_givenOnTheCommandLine0123456789"
    fake, record = _fake_python(tmp_path)
    env = {k: v for k, v in child_env().items() if k != "HF_TOKEN"}
    r = _launch(tmp_path, f"+launch.env.HF_TOKEN={token}", f"launch.python={fake}", env=env)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    for path in run.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), f"the token is in {path.name}"
    assert token not in r.stdout + r.stderr
    script = run / "launch.sh"
    assert "export HF_TOKEN=${HF_TOKEN}" in script.read_text().splitlines()
    assert stat.S_IMODE(script.stat().st_mode) == 0o700
    # Run where the token is set, the worker gets it from that environment; unset, the script stops.
    done = subprocess.run(["bash", str(script)], env={**env, "HF_TOKEN": "from-the-env"}, capture_output=True)
    assert done.returncode == 0 and "HF=from-the-env" in record.read_text()
    unset = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert unset.returncode != 0 and "HF_TOKEN" in unset.stderr


def test_sbatch_script_quotes_and_references_secrets(tmp_path):
    from finetune.core.config import LaunchConfig
    from finetune.launch import stage as launch_stage

    secret = "tok_inTheEnvironment_5678"
    os.environ["SERVICE_TOKEN"] = secret
    try:
        cfg, plan, run = planned_run_dir(tmp_path, "+recipe=llama70b_full")
        launch = LaunchConfig(
            scheduler="slurm", nnodes=2, dry_run=True,
            env={"FORWARDED": secret, "URL": f"https://u:{secret}@host/$x", "PLAIN": "a b;touch x"},
        )  # fmt: skip
        launch_stage.run(cfg, run, plan, launch=launch, runner=Capture(), which=lambda n: None)
    finally:
        del os.environ["SERVICE_TOKEN"]
    path = run / "slurm.sbatch"
    text = path.read_text()
    assert secret not in text and stat.S_IMODE(path.stat().st_mode) == 0o700
    lines = text.splitlines()
    assert "export FORWARDED=${SERVICE_TOKEN}" in lines
    assert 'export URL="https://u:${SERVICE_TOKEN}@host/\\$x"' in lines
    assert "export PLAIN='a b;touch x'" in lines
    probe = (
        "\n".join(x for x in lines if x.startswith("export "))
        + '\nprintf "%s|%s|%s" "$FORWARDED" "$URL" "$PLAIN"\n'
    )
    out = subprocess.run(["bash", "-c", probe], env={"SERVICE_TOKEN": "S"}, capture_output=True, text=True)
    assert out.stdout == "S|https://u:S@host/$x|a b;touch x"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_slurm_names_cannot_carry_lines(tmp_path):
    r = _launch(tmp_path, "launch.scheduler=slurm", "launch.slurm_partition='gpu\ntouch x'")
    assert r.returncode == 2 and "launch.slurm_partition=" in r.stderr and r.stderr.strip().count("\n") == 0


def test_serve_sh_keeps_names_on_their_comment_lines(tmp_path):
    from finetune.export import serve

    cfg, plan = planned("model=llama3_1_8b", "method=lora", "hardware=h100", "train.seq_len=4096")
    target = tmp_path / "pwned"
    evil = f"x\ntouch {target}\n"
    cfg = replace(
        cfg, model=replace(cfg.model, name=evil), export=replace(cfg.export, served_model_name=evil)
    )
    commands = serve.serve_commands(cfg, plan, merged=True, adapter=True, base_source=f"/m/$(touch {target})")
    path = tmp_path / "serve.sh"
    serve.write(cfg, path, commands)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT"\n')
    (bindir / "vllm").chmod(0o755)
    for variant in ("merged", "lora"):
        out = tmp_path / f"{variant}.txt"
        env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "OUT": str(out)}
        assert subprocess.run(["bash", str(path), variant], env=env).returncode == 0
        assert evil.strip("\n").split("\n")[0] in out.read_text()
    assert not target.exists()


# ---------------------------------------------------------------- ${oc.env:...}: forwarded by reference or refused


@pytest.mark.parametrize(
    "override",
    ["name=${oc.env:DATABASE_URL}", "run_dir=/tmp/${oc.env:DATABASE_URL}", "data.path=${oc.env:DATABASE_URL}",
     "+launch.env.DB=pre-${oc.env:DATABASE_URL}", "export.served_model_name=${oc.decode:${oc.env:DATABASE_URL}}"],
)  # fmt: skip
def test_env_interpolation_outside_launch_env_is_refused(tmp_path, override):
    """'name=${oc.env:DATABASE_URL}' would copy any variable into config.yaml in clear: refused in one line, the
    value never printed."""
    value = "postgres://user:pw0123456789@db/prod"
    r = run_cli(
        "mode=plan", f"run_dir={tmp_path / 'run'}", override, env=child_env(DATABASE_URL=value), cwd=tmp_path
    )
    key = override.split("=", 1)[0].lstrip("+")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"{key}: ${{oc.env:...}} is accepted only as the whole value of +launch.env.NAME" in r.stderr
    assert not (tmp_path / "run").exists() and value not in r.stdout + r.stderr


def test_a_variable_forwarded_with_oc_env_is_a_secret_whatever_its_name(tmp_path):
    value = "postgres://user:pw0123456789@db/prod"
    r = _launch(tmp_path, "+launch.env.DB=${oc.env:DATABASE_URL}", env=child_env(DATABASE_URL=value))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    for path in run.rglob("*"):
        if path.is_file():
            assert value.encode() not in path.read_bytes(), f"the value is in {path.name}"
    assert value not in r.stdout + r.stderr
    assert "DB: <redacted:DATABASE_URL>" in (run / "config.yaml").read_text()
    script = run / "launch.sh"
    assert "export DB=${DATABASE_URL}" in script.read_text().splitlines()
    assert stat.S_IMODE(script.stat().st_mode) == 0o700


# ---------------------------------------------------------------- secrets in the data


AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    "text",
    [f"aws_secret_access_key = {AWS_SECRET}", f"key:{AWS_SECRET}.", f'"{AWS_SECRET}"',
     "secret 9f+aB3/dE4kLmN0pQ7rS2tUvWxYz1A/bC5d+Ef6G"],
)  # fmt: skip
def test_aws_secret_keys_with_slashes_are_scrubbed(text):
    from collections import Counter

    from finetune.data import clean

    counts: Counter = Counter()
    out = clean.scrub_pii(text, counts)
    assert "<API_KEY>" in out and counts["API_KEY"] == 1, out
    assert not any(len(w) >= 20 and "/" in w for w in out.replace('"', " ").split())


@pytest.mark.parametrize(
    "text",
    [
        "see /usr/local/lib/python3.11/site-packages/torch/nn",
        "ratio 1/2 and 3/4",
        "a" * 40,
        "abcdefghij/KLMNOPQRST/uvwxyzabcd/EFGHIJKL",
    ],
)
def test_paths_and_plain_words_are_not_taken_for_keys(text):
    from collections import Counter

    from finetune.data import clean

    assert clean.scrub_pii(text, Counter()) == text


def test_aws_secret_in_the_data_reaches_neither_the_cache_nor_the_run(tmp_path, tiny_cache):
    from finetune.data import stage as data_stage
    from finetune.data import synthetic
    from finetune.pipeline.cli import compose

    rows = [{"messages": c} for c in synthetic.conversations(30, seed=2, median_words=8)]
    rows.append({"messages": [{"role": "user", "content": f"my key is {AWS_SECRET} ok"},
                              {"role": "assistant", "content": f"Stored {AWS_SECRET}."}]})  # fmt: skip
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose([f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=512"])
    stats = data_stage.run(cfg, tmp_path / "run")
    assert stats["pii"]["API_KEY"] == 2
    for folder in (tmp_path / "cache", tmp_path / "run"):
        for p in folder.rglob("*"):
            if p.is_file():
                blob = p.read_bytes()
                assert AWS_SECRET.encode() not in blob and b"K7MDENG" not in blob, p
