"""The bad-input campaign: every malformed configuration or data file ends the same way.

One actionable line on stderr naming the key, file or value; exit code 2; no
traceback; nothing written outside the run directory; an existing run (config,
plan, a checkpoint) byte for byte unchanged, also when the bad command names it.
The entry points run in-process (what `python -m finetune` and `python -m
finetune.train` call), which is where a traceback would escape; a few go through
the real command line too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
from helpers import REPO, SEQ_LEN, child_env, prepare_run, run_cli

NEW = "{tmp}/new"  # a fresh run directory
OLD = "{tmp}/existing"  # the run that must survive

# (id, arguments, what the message must contain). Cases without mode= run mode=plan.
CONFIG_CASES = [
    ("seq_len_zero", ["train.seq_len=0"], "train.seq_len=0 must be > 0"),
    ("seq_len_negative", ["train.seq_len=-5"], "train.seq_len=-5 must be > 0"),
    ("seq_len_word", ["train.seq_len=abc"], "train.seq_len='abc'"),
    ("seq_len_beyond_positions", ["train.seq_len=100000"], "exceeds model.max_position_embeddings"),
    ("batch_size_zero", ["train.batch_size=0"], "train.batch_size=0 must be > 0"),
    ("batch_size_float", ["train.batch_size=1.5"], "train.batch_size"),
    ("micro_batch_negative", ["train.micro_batch_size=-1"], "train.micro_batch_size=-1"),
    ("max_steps_zero", ["train.max_steps=0"], "train.max_steps=0"),
    ("epochs_zero", ["train.epochs=0"], "train.epochs=0"),
    ("save_total_limit_zero", ["train.save_total_limit=0"], "train.save_total_limit=0"),
    ("save_steps_negative", ["train.save_steps=-1"], "train.save_steps=-1"),
    ("warmup_ratio_one", ["train.warmup_ratio=1.0"], "train.warmup_ratio=1.0"),
    ("lr_scheduler_unknown", ["train.lr_scheduler=exp"], "train.lr_scheduler='exp'"),
    ("report_to_not_a_list", ["train.report_to=wandbx"], "train.report_to"),
    ("learning_rate_negative", ["method.learning_rate=-1"], "method.learning_rate=-1"),
    ("lora_rank_zero", ["method.lora_rank=0"], "method.lora_rank=0 must be > 0"),
    ("lora_rank_float", ["method.lora_rank=1.5"], "method.lora_rank"),
    ("lora_dropout_above_one", ["method.lora_dropout=1.5"], "method.lora_dropout=1.5"),
    ("unknown_train_key", ["train.foo=1"], "train.foo: unknown key"),
    ("unknown_top_key", ["foo=1"], "foo: unknown key"),
    ("added_key", ["+foo=1"], "foo: unknown key"),
    ("unknown_model", ["model=gpt5"], "model=gpt5: unknown model"),
    ("unknown_method", ["method=dora"], "method=dora: unknown method"),
    ("unknown_hardware", ["hardware=tpu"], "hardware=tpu: unknown hardware"),
    ("unknown_recipe", ["+recipe=nope"], "recipe=nope: unknown recipe"),
    ("recipe_without_plus", ["recipe=tiny"], "write +recipe=tiny"),
    ("unknown_mode", ["mode=fly"], "mode='fly' is not one of"),
    ("paged_optimizer_on_cpu", ["method.optimizer=paged_adamw_8bit"], "paged_adamw_8bit needs CUDA"),
    (
        "qlora_paged_8bit_on_cpu",
        ["method=qlora", "method.optimizer=paged_adamw_8bit", "hardware=cpu", "train.seq_len=256"],
        "paged_adamw_8bit needs CUDA",
    ),
    (
        "qlora_adapting_nothing",  # QLoRA without adapters would be a full fine-tune of a 4-bit model
        ["method=qlora", "method.target_modules=[]", "train.seq_len=256"],
        "method.target_modules is empty",
    ),
    ("kv_heads_not_dividing", ["model.num_kv_heads=3"], "must be a multiple of model.num_kv_heads=3"),
    (
        "offload_params_without_sharding",
        ["train.sharding=ddp", "train.offload_params=true"],
        "offload_params",
    ),
    ("sharding_unknown", ["train.sharding=tp"], "train.sharding='tp'"),
    ("gpus_zero", ["hardware.gpus_per_node=0"], "hardware.gpus_per_node=0"),
    ("headroom_too_big", ["plan.headroom=2"], "plan.headroom=2"),
    ("smoke_not_bool", ["smoke=maybe"], "smoke.enabled"),
    ("eval_fraction_one", ["data.eval_fraction=1.0"], "data.eval_fraction=1.0"),
    ("data_format_unknown", ["data.format=xml"], "data.format='xml'"),
    ("seq_len_auto_before_data", ["train.seq_len=auto"], "train.seq_len=auto needs the data stage"),
    ("config_json_missing", ["model.config_path={tmp}/nope/config.json"], "no such file"),
    ("config_json_broken", ["model.config_path={tmp}/broken.json"], "not a readable JSON file"),
    ("run_dir_under_a_file", ["run_dir={tmp}/afile/run"], "cannot create it"),
    (
        "plan_out_under_a_file",
        ["plan.out={tmp}/afile/plan.json"],
        "plan.out={tmp}/afile/plan.json: cannot write",
    ),
    ("missing_data_file", ["mode=data", "data.path={tmp}/missing.jsonl"], "no such file or folder"),
    # Not a number: NaN passes every range check (comparisons are False), so each float is checked as such.
    ("learning_rate_nan", ["method.learning_rate=nan"], "method.learning_rate=nan must be a finite number"),
    ("learning_rate_inf", ["method.learning_rate=inf"], "method.learning_rate=inf must be a finite number"),
    ("weight_decay_minus_inf", ["method.weight_decay=-inf"], "method.weight_decay=-inf must be a finite"),
    ("lora_dropout_nan", ["method.lora_dropout=nan"], "method.lora_dropout=nan"),
    ("max_grad_norm_nan", ["train.max_grad_norm=nan"], "train.max_grad_norm=nan must be a finite number"),
    ("max_grad_norm_inf", ["train.max_grad_norm=inf"], "train.max_grad_norm=inf must be a finite number"),
    (
        "loss_spike_factor_nan",
        ["train.loss_spike_factor=nan"],
        "train.loss_spike_factor=nan must be a finite",
    ),
    ("epochs_inf", ["train.epochs=inf"], "train.epochs=inf must be a finite number"),
    ("warmup_ratio_nan", ["train.warmup_ratio=nan"], "train.warmup_ratio=nan"),
    ("gpu_memory_inf", ["hardware.gpu_memory_gb=inf"], "hardware.gpu_memory_gb=inf must be a finite number"),
    ("rope_theta_nan", ["model.rope_theta=nan"], "model.rope_theta=nan must be a finite number"),
    ("mfu_nan", ["plan.mfu=nan"], "plan.mfu=nan"),
    ("temperature_nan", ["eval.temperature=nan"], "eval.temperature=nan"),
    ("gpu_utilization_inf", ["export.gpu_memory_utilization=inf"], "export.gpu_memory_utilization=inf"),
    ("rdzv_wait_nan", ["launch.rdzv_wait_s=nan"], "launch.rdzv_wait_s=nan"),
    ("near_dedup_threshold_nan", ["data.near_dedup_threshold=nan"], "data.near_dedup_threshold=nan"),
    ("seq_len_percentile_inf", ["data.seq_len_percentile=inf"], "data.seq_len_percentile=inf"),
    # Names and paths: a run's name cannot leave runs/, the environment is not read into names and paths.
    ("name_up_and_out", ["name=../../x"], "name='../../x': use letters, digits"),
    ("name_with_a_slash", ["name=a/b"], "name='a/b': use letters, digits"),
    ("name_with_a_newline", ["name='a\ntouch x\n#'"], "name='a\\ntouch x\\n#': use letters"),
    ("name_from_the_environment", ["name=${oc.env:HOME}"], "name: ${oc.env:...} is accepted only"),
    (
        "run_dir_from_the_environment",
        ["run_dir=/tmp/${oc.env:HOME}"],
        "run_dir: ${oc.env:...} is accepted only",
    ),
    (
        "launch_env_partly_from_env",
        ["+launch.env.X=a${oc.env:HOME}"],
        "launch.env.X: ${oc.env:...} is accepted",
    ),
    ("run_dir_with_a_newline", ["run_dir='{tmp}/a\nb'"], "holds control characters"),
    ("run_dir_not_ours", ["run_dir={tmp}/emptyfolder/.."], "not a finetune run directory"),
    ("run_dir_package", ["run_dir=" + str(REPO / "finetune")], "inside the installed finetune package"),
    ("run_dir_root", ["run_dir=/"], "run_dir=/: the root of the file system"),
    ("slurm_partition_with_a_newline", ["launch.slurm_partition='gpu\nid'"], "launch.slurm_partition="),
    ("control_tokens_unknown", ["data.control_tokens=strip"], "data.control_tokens='strip'"),
    # The existing run named by a bad command: refused before anything is written there.
    ("bad_value_on_existing_run", ["run_dir=" + OLD, "train.seq_len=0"], "train.seq_len=0"),
    (
        "existing_run_with_another_config",
        ["run_dir=" + OLD, "method.lora_rank=8", "mode=train"],
        "has checkpoints trained with method.lora_rank=32, not 8 (and 1 more change(s)): to keep both, give",
    ),
]

DATA_FILES = {
    "bad_json_line.jsonl": b'{"messages": [{"role": "user", "content": "hi"}]}\n{not json\n',
    "empty.jsonl": b"",
    "latin1.jsonl": '{"prompt": "caf\u00e9", "completion": "x"}\n'.encode("latin-1"),
    "unknown_role.jsonl": b'{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}\n',
    "messages_not_a_list.jsonl": b'{"messages": "hello"}\n',
    "no_known_fields.jsonl": b'{"question": "a", "answer": "b"}\n',
    "notes.txt": b"just text\n",
    "bad.parquet": b"PAR1 not really parquet",
    "csv_without_columns.csv": b"a,b\n1,2\n",
    "lone_surrogate.jsonl": b'{"messages": [{"role": "user", "content": "x \\ud800"}, {"role": "assistant", "content": "y"}]}\n',
    "lone_surrogate.json": b'[{"prompt": "fine", "completion": "\\udc00 end"}]',
}

DATA_CASES = [
    ("data_bad_json_line", "bad_json_line.jsonl", "line 2"),
    ("data_empty_file", "empty.jsonl", "empty.jsonl"),
    ("data_invalid_utf8", "latin1.jsonl", "latin1.jsonl"),
    ("data_unknown_role", "unknown_role.jsonl", "unknown_role.jsonl"),
    ("data_messages_not_a_list", "messages_not_a_list.jsonl", "messages_not_a_list.jsonl"),
    ("data_no_known_fields", "no_known_fields.jsonl", "no_known_fields.jsonl"),
    ("data_unsupported_type", "notes.txt", "unsupported file type"),
    ("data_broken_parquet", "bad.parquet", "not a readable Parquet file"),
    ("data_csv_without_columns", "csv_without_columns.csv", "csv_without_columns.csv"),
    ("data_folder_without_files", "emptyfolder", "no .jsonl"),
    ("data_lone_surrogate", "lone_surrogate.jsonl", "holds a lone surrogate '\\ud800' at character 2"),
    ("data_lone_surrogate_json", "lone_surrogate.json", "completion holds a lone surrogate '\\udc00'"),
]


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_cache):
    """A folder with an existing run (config, plan, data, a sealed checkpoint), data files, and traps."""
    from finetune.pipeline.cli import compose
    from finetune.rundir import checkpoints

    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "afile").write_text("a file where a folder is expected\n")
    (tmp / "broken.json").write_text("{not json")
    (tmp / "emptyfolder").mkdir()
    for name, blob in DATA_FILES.items():
        (tmp / name).write_bytes(blob)
    old = tmp / "existing"
    prepare_run(compose([f"run_dir={old}", f"data.cache_dir={tmp / 'cache'}", SEQ_LEN]))
    staged = old / "checkpoints" / checkpoints.STAGING_DIR / "checkpoint-2"
    staged.mkdir(parents=True)
    (staged / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    checkpoints.finalize(staged, old / "checkpoints" / "checkpoint-2")
    return tmp


def _cli(args: list[str], capsys) -> tuple[int, str]:
    from finetune.pipeline.cli import main

    code = main(args)
    out = capsys.readouterr()
    return code, out.err


def _expect_clean_refusal(
    world: Path, run: Path, code: int, err: str, needle: str, before, old_before
) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err  # one line
    assert needle.replace("{tmp}", str(world)) in lines[0], lines[0]
    after = _digest(world)
    outside = {k: v for k, v in after.items() if not (world / k).is_relative_to(run)}
    assert outside == {k: v for k, v in before.items() if not (world / k).is_relative_to(run)}
    assert _digest(world / "existing") == old_before


@pytest.mark.parametrize("case, args, needle", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_configuration(world, capsys, monkeypatch, case, args, needle):
    monkeypatch.chdir(world)
    args = [a.replace("{tmp}", str(world)) for a in args]
    run = Path(next((a.split("=", 1)[1] for a in args if a.startswith("run_dir=")), NEW.format(tmp=world)))
    if not any(a.startswith("run_dir=") for a in args):
        args.append(f"run_dir={run}")
    if not any(a.startswith("mode=") for a in args):
        args.append("mode=plan")
    args.append(f"data.cache_dir={world / 'cache'}")
    before, old_before = _digest(world), _digest(world / "existing")
    code, err = _cli(args, capsys)
    _expect_clean_refusal(world, run, code, err, needle, before, old_before)


@pytest.mark.parametrize("case, name, needle", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_file(world, capsys, monkeypatch, case, name, needle):
    monkeypatch.chdir(world)
    run = world / f"run-{case}"
    args = ["mode=data", f"data.path={world / name}", f"run_dir={run}", f"data.cache_dir={world / 'cache'}"]
    args += [SEQ_LEN]
    before, old_before = _digest(world), _digest(world / "existing")
    code, err = _cli(args, capsys)
    _expect_clean_refusal(world, run, code, err, needle, before, old_before)


# ---------------------------------------------------------------- the training worker's own refusals


def _worker_case(world: Path, name: str, edit) -> Path:
    """A copy of the existing run's config and plan (and data) with one thing made wrong."""
    import shutil

    run = world / f"worker-{name}"
    shutil.copytree(world / "existing", run, ignore=shutil.ignore_patterns(".lock", "checkpoints"))
    edit(run)
    return run


def _edit_plan(**changes):
    def edit(run: Path) -> None:
        plan = json.loads((run / "plan.json").read_text())
        for key, value in changes.items():
            section, _, field = key.partition(".")
            if field:
                plan[section][field] = value
            else:
                plan[section] = value
        (run / "plan.json").write_text(json.dumps(plan))

    return edit


def _edit_config(old: str, new: str):
    def edit(run: Path) -> None:
        path = run / "config.yaml"
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))

    return edit


WORKER_CASES = [
    ("disk_too_small", _edit_plan(**{"disk_gb.checkpoint": 1e9}), "disk: "),
    ("ram_too_small", _edit_plan(host_memory_gb=1e9), "host memory: the plan needs"),
    (
        "resume_missing",
        _edit_config("resume: true", "resume: /no/such/checkpoint"),
        "resume=/no/such/checkpoint",
    ),
    ("plan_missing", lambda run: (run / "plan.json").unlink(), "plan.json: missing"),
    ("plan_from_an_older_finetune", _edit_plan(layout=None), "plan.json was written by an older finetune"),
    (
        "engine_missing",
        lambda run: (run / "engine.json").unlink(),
        "engine.json: missing; the launcher writes it",
    ),
    ("data_missing", lambda run: __import__("shutil").rmtree(run / "data"), "no prepared data"),
    pytest.param(
        "cuda_plan_without_cuda",
        _edit_plan(**{"hardware.device": "cuda"}),  # plan.json's profile is what the worker runs
        "plans for 1 CUDA GPU(s)",
        marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA"),
        id="cuda_plan_without_cuda",
    ),
]


@pytest.mark.parametrize(
    "case, edit, needle", WORKER_CASES, ids=[getattr(c, "id", None) or c[0] for c in WORKER_CASES]
)
def test_worker_refuses_before_training(world, capsys, case, edit, needle):
    from finetune.train.__main__ import main

    run = _worker_case(world, case, edit)
    before, old_before = _digest(world), _digest(world / "existing")
    code = main([str(run)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and needle in lines[0], err
    assert not (run / "checkpoints").exists() and not (run / "metrics.json").exists()
    assert _digest(world) == before and _digest(world / "existing") == old_before


# ---------------------------------------------------------------- the real command line


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train.seq_len=0"], "train.seq_len=0 must be > 0"),
        (["method.lora_rank=abc"], "method.lora_rank"),
        (["data.path={tmp}/missing.jsonl", "mode=data"], "no such file or folder"),
    ],
)
def test_command_line_exit_2_one_line(world, args, needle):
    args = [a.replace("{tmp}", str(world)) for a in args]
    old_before = _digest(world / "existing")
    mode = [] if "mode=data" in args else ["mode=plan"]
    r = run_cli(
        *args, *mode, f"run_dir={world / 'cli'}", f"data.cache_dir={world / 'cache'}",
        cwd=world, env=child_env(), timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and needle.replace("{tmp}", str(world)) in r.stderr
    assert _digest(world / "existing") == old_before


# ---------------------------------------------------------------- a full disk: one line, the path and the bytes


def _no_space(path: str = "") -> OSError:
    import errno

    return OSError(errno.ENOSPC, "No space left on device", path or None)


def test_full_disk_writing_the_run_directory(world, capsys, monkeypatch):
    run = world / "full-disk"

    def fsync(fd):
        raise _no_space()

    monkeypatch.setattr(os, "fsync", fsync)
    code, err = _cli(["mode=plan", f"run_dir={run}"], capsys)
    monkeypatch.undo()
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"finetune: error: disk full: {run}/") and " B" in lines[0]
    assert "needs about" in lines[0] and "free" in lines[0]
    assert not (run / "config.yaml").exists() and not (run / "plan.json").exists()


def test_full_disk_building_the_data_cache(world, capsys, monkeypatch):
    from finetune.data import conversations

    cache = world / "full-cache"

    def save(prepared, out):
        (out / "train").mkdir()
        raise _no_space(str(out / "train" / "data-00000-of-00001.arrow"))

    monkeypatch.setattr(conversations, "save", save)
    run = world / "full-data"
    code, err = _cli(["mode=data", f"run_dir={run}", f"data.cache_dir={cache}", SEQ_LEN], capsys)
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("data:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"finetune: error: disk full: {cache}: ") and "needs about" in lines[0]
    assert " kB" in lines[0] or " MB" in lines[0]  # the prepared data's size, in units that mean something
    assert list(cache.rglob("stats.json")) == [] and not (run / "data").exists()


def test_full_disk_during_a_checkpoint_save_and_the_rerun(world, capsys, monkeypatch):
    """A full disk mid-checkpoint, and the rerun after it: each one line naming the path and the bytes needed,
    not torch's `RuntimeError: basic_ios::clear: iostream error` or an OSError traceback."""
    import shutil
    from collections import namedtuple

    import torch

    from finetune.rundir import preflight
    from finetune.train.__main__ import main

    assert (
        preflight.check.__kwdefaults__["disk_usage"] is shutil.disk_usage
    )  # bound before the disk fills below
    run = _worker_case(world, "full-disk-save", lambda run: None)
    (run / "config.yaml").write_text(
        (run / "config.yaml")
        .read_text()
        .replace("max_steps: -1", "max_steps: 4")
        .replace("save_steps: 200", "save_steps: 2")
    )
    real_save, full = torch.save, []

    def failing_save(obj, f, *args, **kwargs):  # the disk fills up at the first checkpoint
        if "checkpoint-2" in str(f):
            full.append(True)
            raise RuntimeError("basic_ios::clear: iostream error")
        return real_save(obj, f, *args, **kwargs)

    usage = namedtuple("usage", "total used free")
    # The worker's log handler writes to the stderr of the test that first ran it in this process: a fresh one.
    monkeypatch.setattr(logging.getLogger("finetune"), "handlers", [])
    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 4096 if full else 10**12))
    code = main([str(run)])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("finetune.train:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert f"disk full: {run / 'checkpoints'}: 4.1 kB free, needs about" in lines[0]
    assert "checkpoint-2" not in [p.name for p in (run / "checkpoints").iterdir()]  # never half-sealed

    # The rerun on the still full disk (the preflight sees the real disk, as a small shortfall goes unseen):
    # the same one line, no OSError traceback.
    code = main([str(run)])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("finetune")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert f"disk full: {run / 'checkpoints'}: 4.1 kB free, needs about" in lines[0]

    # A worker whose very first write fails (its lock file): one line as well, not an OSError traceback.
    other = _worker_case(world, "full-disk-lock", lambda run: None)

    def fsync(fd):
        raise _no_space()

    monkeypatch.setattr(os, "fsync", fsync)
    code = main([str(other)])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("finetune")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"finetune.train: disk full: {other / '.lock'}: 4.1 kB free, needs about")


def test_a_write_error_with_room_to_spare_is_not_called_a_full_disk(tmp_path):
    from finetune.train.__main__ import disk_full

    (tmp_path / "plan.json").write_text(json.dumps({"disk_gb": {"checkpoint": 0.001}}))
    assert disk_full(RuntimeError("basic_ios::clear: iostream error"), str(tmp_path)) is None  # disk has room
    assert disk_full(RuntimeError("CUDA out of memory"), str(tmp_path)) is None
    assert disk_full(_no_space(str(tmp_path / "x")), str(tmp_path)) is not None


def test_preflight_disk_message_uses_units_that_mean_something(tmp_path):
    from collections import namedtuple
    from types import SimpleNamespace

    from finetune.core.errors import LaunchError, format_bytes
    from finetune.pipeline.cli import compose
    from finetune.rundir import preflight

    usage = namedtuple("usage", "total used free")
    # a 20 kB checkpoint, a 300 kB merged export
    plan = SimpleNamespace(disk_checkpoint_gb=20e3 / 1e9, disk_export_gb=300e3 / 1e9, host_memory_gb=0.0)
    cfg = compose(["train.save_total_limit=2", "mode=train"])
    with pytest.raises(LaunchError) as exc:
        preflight.check(cfg, tmp_path, plan, disk_usage=lambda p: usage(10**6, 10**6, 5_000))
    assert (
        f"disk: {tmp_path} has 5.0 kB free, the run needs about 80.0 kB (20.0 kB a checkpoint x 2 kept "
        "(train.save_total_limit) + one being written + the output); free space" in str(exc.value)
    )
    # mode=all exports after training in the same command: the merged model is counted too
    with pytest.raises(LaunchError) as exc:
        preflight.check(
            compose(["train.save_total_limit=2", "mode=all"]),
            tmp_path,
            plan,
            disk_usage=lambda p: usage(10**6, 10**6, 100_000),
        )
    assert (
        f"disk: {tmp_path} has 100.0 kB free, the run needs about 380.0 kB (20.0 kB a checkpoint x 2 kept "
        "(train.save_total_limit) + one being written + the output + the merged export, 300.0 kB); free space"
        in str(exc.value)
    )
    assert [format_bytes(n) for n in (0, 999, 1_500, 2.5e6, 3e9, 4.2e12)] == [
        "0 B", "999 B", "1.5 kB", "2.5 MB", "3.0 GB", "4.2 TB",
    ]  # fmt: skip
