"""Batched generation: the chat template with the generation prompt, left padding, one sampling setup.

Base, fine-tuned and merged models go through this one function with the same
`EvalConfig`, so they see the same rendered prompts and the same sampling
(greedy by default; with sampling, the seed is reset before each model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from finetune.core.config.evaluation import EvalConfig
from finetune.modeling import vision


def sampling_kwargs(cfg: EvalConfig) -> dict[str, Any]:
    """`generate()` keyword arguments for the configured decoding (recorded in metrics.json too)."""
    if cfg.greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": None}


def _progress(enabled: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not enabled,
    )


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    conversations: Sequence[list[dict]],
    cfg: EvalConfig,
    label: str = "generating",
) -> list[str]:
    """One answer per conversation (messages up to, not including, the answer to produce)."""
    if not conversations:
        return []
    device = next(model.parameters()).device
    processor, tokenizer = (
        tokenizer,
        getattr(tokenizer, "tokenizer", tokenizer),
    )  # a VLM's processor: its tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    if not cfg.greedy:
        torch.manual_seed(cfg.seed)
    answers: list[str] = []
    try:
        with _progress(cfg.progress) as progress:
            task = progress.add_task(label, total=len(conversations))
            for start in range(0, len(conversations), cfg.batch_size):
                chunk = [list(c) for c in conversations[start : start + cfg.batch_size]]
                if processor is not tokenizer:  # the prompts' images through the model's processor
                    enc = vision.rendered(
                        processor, chunk, [[] for _ in chunk], add_generation_prompt=True, padding_side="left"
                    )
                else:
                    enc = tokenizer.apply_chat_template(
                        chunk, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
                    )
                # pixel values in the model's dtype (a bf16 model)
                enc = {
                    k: v.to(device, model.dtype) if v.is_floating_point() else v.to(device)
                    for k, v in enc.items()
                }
                # a mixture of experts whose config asks for router logits (TRL sets it for the auxiliary
                # loss): transformers' load-balancing loss cannot take a cached step's logits with the whole
                # attention mask, and generation needs none of it
                if getattr(getattr(model, "config", None), "output_router_logits", False):
                    enc["output_router_logits"] = False
                out = model.generate(
                    **enc,
                    max_new_tokens=cfg.max_new_tokens,
                    pad_token_id=pad_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling_kwargs(cfg),
                )
                new = out[:, enc["input_ids"].shape[1] :]
                answers += [a.strip() for a in tokenizer.batch_decode(new, skip_special_tokens=True)]
                progress.advance(task, len(chunk))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers
