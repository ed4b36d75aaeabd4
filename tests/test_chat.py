"""`mode=chat`: lines piped to standard input are answered by the run's model, as the evaluation generates,
with the conversation kept between turns; a model the run does not have is one line and exit 2."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, child_env, make_adapter_run, tiny_cfg


@pytest.fixture
def adapter_run(tmp_path: Path, tiny_cache, tiny_model_cfg):
    """A run directory holding a tiny LoRA adapter, as training leaves it; its config."""
    cfg = tiny_cfg("eval.max_new_tokens=6", run_dir=tmp_path / "run")
    make_adapter_run(tmp_path / "run", tiny_model_cfg, cfg.method)
    return cfg


def test_piped_lines_get_the_evaluations_answers_with_the_history(adapter_run) -> None:
    from dataclasses import replace

    from finetune.evaluation import chat
    from finetune.evaluation.generate import generate
    from finetune.modeling import models, variants
    from finetune.pipeline.stages import resolve

    cfg = resolve(adapter_run)
    run_dir = Path(cfg.run_dir)
    out, err = io.StringIO(), io.StringIO()
    lines = "what is 2+2?\nand 3+3?\n/reset\nwhat is 2+2?\n/exit\nnever read\n"
    assert chat.run(cfg, run_dir, stdin=io.StringIO(lines), stdout=out, stderr=err) == 0
    answers = [line.removeprefix(chat.ANSWER) for line in out.getvalue().splitlines()]
    assert len(answers) == 3 and all(line.startswith(chat.ANSWER) for line in out.getvalue().splitlines())
    # the same model and settings the evaluation uses, the conversation carried over until /reset
    model = variants.load_variant(cfg, run_dir, "trained")
    tokenizer = models.load_tokenizer(cfg.model)
    settings = replace(cfg.eval, batch_size=1, progress=False)
    first = [{"role": "user", "content": "what is 2+2?"}]
    (a1,) = generate(model, tokenizer, [first], settings)
    (a2,) = generate(
        model,
        tokenizer,
        [[*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "and 3+3?"}]],
        settings,
    )
    assert answers == [a1, a2, a1]
    assert "chat: the trained model of" in err.getvalue() and "(conversation cleared)" in err.getvalue()


@pytest.mark.slow
def test_the_command_line_chats_and_refuses_a_missing_model(adapter_run, tiny_cache) -> None:
    run_dir = adapter_run.run_dir
    env = child_env(FINETUNE_CACHE=str(tiny_cache))
    args = ("mode=chat", f"run_dir={run_dir}", "eval.max_new_tokens=4", "train.seq_len=128")
    proc = subprocess_run(args, "hello\nhow are you?\n", env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line[: len("assistant> ")] for line in proc.stdout.splitlines()] == ["assistant> "] * 2
    missing = subprocess_run((*args, "chat.model=merged"), "hello\n", env)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip().splitlines()[-1] == (
        f"finetune: error: chat.model=merged: {run_dir} has no merged model yet (it has: base, trained); run "
        "mode=export first, or chat.model=base"
    )


def subprocess_run(args: tuple[str, ...], text: str, env: dict) -> subprocess.CompletedProcess[str]:
    """`python -m finetune ARGS` with `text` piped to its standard input."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args],
        input=text,
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_image_pictures_go_with_the_next_message_of_a_vision_model(tmp_path, tiny_cache, monkeypatch) -> None:
    from dataclasses import replace

    from PIL import Image

    from finetune.data import shapes
    from finetune.evaluation import chat
    from finetune.evaluation.generate import generate
    from finetune.modeling import models, variants, vision
    from finetune.pipeline.cli import compose

    cfg = compose(["+recipe=tiny_vlm", "chat.model=base", "eval.max_new_tokens=4", f"run_dir={tmp_path}"])
    data = shapes.bundled_path()
    record = json.loads(data.read_text().splitlines()[0])
    picture = data.parent / record["messages"][0]["content"][0]["image"]
    lines = f"/image {tmp_path / 'missing.png'}\n/image {picture}\nWhat shape is it?\n/exit\n"
    out, err = io.StringIO(), io.StringIO()
    asked = []
    monkeypatch.setattr(
        chat,
        "generate",
        lambda m, t, convs, s: asked.append([list(c) for c in convs]) or generate(m, t, convs, s),
    )
    assert chat.run(cfg, tmp_path, stdin=io.StringIO(lines), stdout=out, stderr=err) == 0
    assert len(asked) == 1 and len(asked[0]) == 1  # one question, one conversation
    turn_seen = asked[0][0][-1]
    assert [p["type"] for p in turn_seen["content"]] == ["image", "text"]
    with Image.open(picture) as sent:
        assert turn_seen["content"][0]["image"].size == sent.size
    (answer,) = [line.removeprefix(chat.ANSWER) for line in out.getvalue().splitlines()]
    assert f"image {tmp_path / 'missing.png'} is not a file" in err.getvalue()  # said; the chat went on
    assert "(1 image(s) go with your next message)" in err.getvalue()

    # the answer is the one the evaluation generates for that picture and question
    model = variants.load_variant(cfg, tmp_path, "base")
    parts = [{"type": "image"}, {"type": "text", "text": "What shape is it?"}]
    turn = vision.with_images([{"role": "user", "content": parts}], [picture.read_bytes()])
    settings = replace(cfg.eval, batch_size=1, progress=False)
    assert [answer] == generate(model, models.load_tokenizer(cfg.model), [turn], settings)


def test_image_on_a_text_model_is_said_and_the_chat_goes_on(adapter_run) -> None:
    from finetune.evaluation import chat
    from finetune.pipeline.stages import resolve

    cfg = resolve(adapter_run)
    out, err = io.StringIO(), io.StringIO()
    lines = "/image x.png\nwhat is 2+2?\n"
    assert chat.run(cfg, Path(cfg.run_dir), stdin=io.StringIO(lines), stdout=out, stderr=err) == 0
    assert "takes no images" in err.getvalue() and len(out.getvalue().splitlines()) == 1
