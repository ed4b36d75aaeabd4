"""`mode=chat`: lines piped to standard input are answered by the run's model, as the evaluation generates,
with the conversation kept between turns; a model the run does not have is one line and exit 2."""

from __future__ import annotations

import io
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
