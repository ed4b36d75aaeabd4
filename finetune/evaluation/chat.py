"""`python -m finetune mode=chat`: talk to a run's model in the terminal, on the CPU or a GPU.

    python -m finetune mode=chat                        # the trained adapter (or model) of runs/tiny
    python -m finetune +recipe=smollm2_135m_lora mode=chat chat.model=base
    echo "What is 2+2?" | python -m finetune mode=chat  # one answer a line of standard input

The model is the run's (`chat.model`: base, trained or merged, as the evaluation names them), loaded as the
evaluation loads it, and each answer is generated as the evaluation generates (transformers' `generate`
through the model's chat template, `eval.greedy`, `eval.temperature`, `eval.top_p`, `eval.seed`,
`eval.max_new_tokens`). The conversation is kept between turns; `/reset` starts it again, `/exit` or the
end of input ends the chat. With a model that takes images, `/image PATH` (a file or a folder of images, read
as the data stage reads them) puts the pictures before the text of the next message.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, TextIO

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import DataError, LaunchError
from finetune.data.image_conversations import read_images
from finetune.evaluation.generate import generate
from finetune.modeling import models, variants, vision

PROMPT = "you> "
ANSWER = "assistant> "
IMAGE = "/image"


def _user_turn(text: str, images: list[bytes]) -> dict:
    """The user's message: the text, after the pictures `/image` named (as the data's image parts are)."""
    if not images:
        return {"role": "user", "content": text}
    parts = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    return vision.with_images([{"role": "user", "content": parts}], images)[0]


def _run_config(cfg: Config, run_dir: Path) -> Config:
    """The run's own resolved config where it has one (the model and method it trained), with this command's
    chat and generation settings; else this command's (the base needs no run)."""
    if not (run_dir / rundir.CONFIG_FILE).is_file():
        return cfg
    saved = rundir.load_config(run_dir)
    return replace(saved, chat=cfg.chat, eval=cfg.eval, run_dir=str(run_dir))


def load(cfg: Config, run_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of `chat.model`, or a one-line LaunchError saying which stage makes it."""
    variant = cfg.chat.model
    available = variants.available_variants(cfg, run_dir)
    if variant not in available:
        stage = "mode=train" if variant == "trained" else "mode=export"
        raise LaunchError(
            f"chat.model={variant}: {run_dir} has no {variant} model yet (it has: {', '.join(available)}); run "
            f"{stage} first, or chat.model=base"
        )
    model = variants.load_variant(cfg, run_dir, variant)
    model.eval()
    return model, models.load_tokenizer(cfg.model)


def run(
    cfg: Config,
    run_dir: Path,
    stdin: Optional[TextIO] = None,
    stdout: Optional[TextIO] = None,
    stderr: Optional[TextIO] = None,
) -> int:
    """The chat loop: one answer a line read, the conversation kept; 0 at the end of input or `/exit`."""
    from transformers.utils import logging as transformers_logging

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    transformers_logging.disable_progress_bar()  # the weights' loading bar: noise between the prompts
    cfg = _run_config(cfg, run_dir)
    model, tokenizer = load(cfg, run_dir)
    settings = replace(cfg.eval, batch_size=1, progress=False)
    interactive = stdin.isatty()
    start = [{"role": "system", "content": cfg.chat.system_prompt}] if cfg.chat.system_prompt else []
    print(
        f"chat: the {cfg.chat.model} model of {run_dir} ({cfg.model.name}, {cfg.method.name}); "
        "/reset starts over, /exit or Ctrl-D ends",
        file=stderr,
    )
    conversation = list(start)
    images: list[bytes] = []  # named by /image, sent with the next message
    while True:
        if interactive:
            stdout.write(PROMPT)
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            conversation, images = list(start), []
            print("(conversation cleared)", file=stderr)
            continue
        if text == IMAGE or text.startswith(IMAGE + " "):
            if not cfg.model.takes_images:
                print(f"(model={cfg.model.name} takes no images)", file=stderr)
                continue
            try:  # a bad path is said and the chat goes on
                images += read_images(text.removeprefix(IMAGE).strip(), Path.cwd(), IMAGE)
            except (DataError, OSError) as exc:
                print(f"({exc})", file=stderr)
                continue
            print(f"({len(images)} image(s) go with your next message)", file=stderr)
            continue
        conversation.append(_user_turn(text, images))
        images = []
        (answer,) = generate(model, tokenizer, [conversation], settings)
        conversation.append({"role": "assistant", "content": answer})
        print(f"{ANSWER}{answer}", file=stdout, flush=True)
