"""The newer surfaces against the same hostile and unlucky cases as the older ones: image files that are FIFOs,
devices, too large, damaged or decompression bombs; a reward model's files that never end; a teacher or reward
model saved again between a run and its resume; activation offloading asked for on the CPU. Each ends in one
line and exit 2, or works."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers import SEQ_LEN, run_cli, run_modes, tiny_cfg

from finetune import rundir
from finetune.core.config.grpo import check_reward_model
from finetune.core.errors import ConfigError, DataError
from finetune.data import image_conversations, sources

# ---------------------------------------------------------------- image files


def _png(path: Path, size: tuple[int, int] = (8, 8), mode: str = "RGB") -> Path:
    from PIL import Image

    Image.new(mode, size).save(path)
    return path


def _record(image: str, tmp_path: Path) -> sources.Record:
    data = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}],
            },
            {"role": "assistant", "content": "a square"},
        ]
    }
    return sources.Record(str(tmp_path / "chat.jsonl"), 3, data)


def _refusal(image: str, tmp_path: Path) -> str:
    t0 = time.perf_counter()
    with pytest.raises(DataError) as err:
        image_conversations._sample(_record(image, tmp_path))
    assert time.perf_counter() - t0 < 10  # refused, not read or decoded at length
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'chat.jsonl'}:3: ")
    return message


def test_a_good_image_is_read_whole(tmp_path):
    png = _png(tmp_path / "ok.png")
    sample = image_conversations._sample(_record("ok.png", tmp_path))
    assert sample.images == [png.read_bytes()]


def test_an_image_that_is_a_fifo_or_a_device_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    assert "image pipe.png is not a file" in _refusal("pipe.png", tmp_path)
    assert "image zero.png is not a file" in _refusal("zero.png", tmp_path)


def test_an_image_file_past_the_bound_is_refused_before_it_is_read(tmp_path):
    with (tmp_path / "huge.png").open("wb") as f:  # sparse: no disk taken
        f.truncate(image_conversations.IMAGE_LIMIT + 1)
    message = _refusal("huge.png", tmp_path)
    assert f"image={tmp_path / 'huge.png'}: 67.1 MB, more than the 67.1 MB such a file may hold" in message


def test_a_damaged_image_or_another_file_is_one_line(tmp_path):
    (tmp_path / "noise.png").write_bytes(os.urandom(300))
    assert "image " + str(tmp_path / "noise.png") + " is not an image PIL can read" in _refusal(
        "noise.png", tmp_path
    )
    whole = _png(tmp_path / "whole.png", (64, 64)).read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[: len(whole) // 2])
    assert "cannot be decoded (OSError: " in _refusal("cut.png", tmp_path)


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path):
    """A 1-bit PNG of 400 million pixels is 50 KB on disk and 400 MB decoded: refused before any pixel is."""
    from PIL import Image

    bomb = tmp_path / "bomb.png"
    Image.new("1", (20_000, 20_000)).save(bomb, optimize=True)
    assert bomb.stat().st_size < 1 << 20
    message = _refusal("bomb.png", tmp_path)
    assert f"image {bomb} refused: Image size (400000000 pixels) exceeds limit" in message


def test_a_damaged_image_ends_the_data_stage_in_one_line(tmp_path, tiny_cache):
    _png(tmp_path / "ok.png")
    (tmp_path / "noise.png").write_bytes(os.urandom(300))
    good = _record("ok.png", tmp_path).data
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(_record("noise.png", tmp_path).data) + "\n")
    proc = run_cli("mode=data", "+recipe=tiny_vlm", f"data.path={data}", f"run_dir={tmp_path / 'run'}",
                   f"data.cache_dir={tmp_path / 'cache'}")  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lines[-1].endswith("is not an image PIL can read (damaged, or another kind of file)")
    assert f"{data}:2: image" in lines[-1]
    assert not (tmp_path / "run" / "data").exists()


# ---------------------------------------------------------------- a reward model's files


def _classifier(folder: Path) -> Path:
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_reward_models_files_are_read_through_the_bounded_reader(tmp_path):
    """config.json or config.yaml a FIFO (which would block), /dev/zero (which never ends), or nested past
    Python's recursion limit: one line naming the key, at once."""
    assert check_reward_model(str(_classifier(tmp_path / "ok"))) == "folder"
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    os.mkfifo(pipe / "config.json")
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / "config.yaml").symlink_to("/dev/zero")
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    for folder, what in (
        (pipe, f"objective.reward_model={pipe / 'config.json'}: is a FIFO (named pipe), not a file"),
        (zero, f"objective.reward_model={zero / 'config.yaml'}: is a character device, not a file"),
        (deep, f"objective.reward_model={deep}: config.json cannot be read (maximum recursion depth"),
    ):
        t0 = time.perf_counter()
        with pytest.raises(ConfigError) as err:
            check_reward_model(str(folder))
        assert time.perf_counter() - t0 < 5
        assert str(err.value).startswith(what) and "\n" not in str(err.value)


# ---------------------------------------------------------------- frozen models beside the policy, on resume


def _run_with_checkpoints(tmp_path: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    cfg = tiny_cfg(f"run_dir={run}", *overrides)
    rundir.prepare(cfg)
    rundir.save_config(cfg, run)
    (run / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    return run


@pytest.mark.parametrize("role", ["teacher", "reward_model"])
def test_a_teacher_or_reward_model_saved_again_is_another_run(tmp_path, role):
    """The same path holding another model since the checkpoints were trained: refused as another `init_from`
    is; unchanged, or a preset named by name, the run resumes."""
    folder = _classifier(tmp_path / "frozen")
    (folder / "model.safetensors").write_bytes(b"first weights")
    setting = (
        ("objective=distill", f"objective.teacher={folder}")
        if role == "teacher"
        else ("objective=grpo", "objective.num_generations=4", f"objective.reward_model={folder}")
    )
    run = _run_with_checkpoints(tmp_path, *setting)
    assert f"objective.{role} identity" in json.loads((run / rundir.RESUME_FILE).read_text())
    rundir.check_resumable(tiny_cfg(f"run_dir={run}", *setting), run)
    (folder / "model.safetensors").write_bytes(b"weights trained again")
    with pytest.raises(ConfigError) as err:
        rundir.check_resumable(tiny_cfg(f"run_dir={run}", *setting), run)
    assert str(err.value).startswith(
        f"run_dir={run} has checkpoints trained with objective.{role} holding files:"
    ) and "now (another model): to keep both, give this experiment its own run directory" in str(err.value)
    rundir.check_resumable(tiny_cfg(f"run_dir={run}", *setting, "resume=false"), run)  # starting over: fine
    preset = _run_with_checkpoints(tmp_path / "preset", "objective=distill", "objective.teacher=tiny")
    assert "objective.teacher identity" not in json.loads((preset / rundir.RESUME_FILE).read_text())
    rundir.check_resumable(
        tiny_cfg(f"run_dir={preset}", "objective=distill", "objective.teacher=tiny"), preset
    )


# ---------------------------------------------------------------- activation offloading on the CPU


def test_activation_offloading_on_the_cpu_is_dropped_with_a_note(tmp_path):
    """Offloading moves activations to host memory: on the CPU they are there already, and TRL's offloading
    needs an accelerator. The plan drops it and says so; on a GPU profile it stays."""
    from finetune.pipeline.stages import plan_stage, resolve

    cfg = resolve(tiny_cfg("hardware=cpu", "train.activation_offloading=true", run_dir=tmp_path / "run"))
    rundir.prepare(cfg)
    plan = plan_stage(cfg, tmp_path / "run", quiet=True)
    assert plan.strategy.activation_offloading is False
    note = (
        "train.activation_offloading=true dropped: on the CPU (hardware.device=cpu) the activations are in "
        "host memory already"
    )
    assert note in plan.reasons
    written = json.loads((tmp_path / "run" / rundir.PLAN_FILE).read_text())
    assert written["strategy"]["activation_offloading"] is False and note in written["reasons"]
    unset = plan_stage(
        resolve(tiny_cfg("hardware=cpu", run_dir=tmp_path / "run")), tmp_path / "run", quiet=True
    )
    assert note not in unset.reasons
    gpu = resolve(tiny_cfg("hardware=h100", "train.activation_offloading=true", run_dir=tmp_path / "gpu"))
    rundir.prepare(gpu)
    on_gpu = plan_stage(gpu, tmp_path / "gpu", quiet=True)
    assert on_gpu.strategy.activation_offloading is True and note not in on_gpu.reasons


@pytest.mark.slow  # one short training run
def test_activation_offloading_on_the_cpu_trains(tmp_path, tiny_cache):
    """What crashed inside TRL (its offloading streams to an accelerator) plans without it, says so, and trains."""
    run = tmp_path / "run"
    args = [
        f"run_dir={run}",
        "hardware=cpu",
        SEQ_LEN,
        "train.max_steps=1",
        "train.batch_size=2",
        "train.report_to=[]",
        "train.activation_offloading=true",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    planned = run_modes(args, run, modes=("data", "plan"))
    assert "train.activation_offloading=true dropped" in " ".join(planned.split())
    run_modes(args, run, modes=("train",))
    train = json.loads((run / "metrics.json").read_text())["train"]
    assert train["steps"] == 1 and train["engine"]["activation_offloading"] is False
