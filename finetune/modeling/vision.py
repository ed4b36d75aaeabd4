"""Vision-language models: their processor renders a conversation with its images, for the data stage's
lengths, the trainer's batches and the evaluation's prompts alike.

A conversation's image parts are `{"type": "image"}` placeholders, filled in order with the row's images
(the bytes the data stage stored), so every stage hands the processor the same pictures and it resizes them
by its own rules. Labels are the assistant text only: the processor's assistant mask from the chat
template's `{% generation %}` markers (TRL's `DataCollatorForVisionLanguageModeling` with
`assistant_only_loss`), so image tokens, which sit in user turns, are never labelled.

transformers, TRL and PIL are imported inside the functions.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from finetune.modeling.collator import IGNORE_INDEX, NUM_TOKENS_KEY

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


def open_image(data: Any) -> Any:
    """A PIL image in RGB from its bytes (or a datasets Image value, which is one already)."""
    from PIL import Image

    if isinstance(data, (bytes, bytearray)):
        data = Image.open(io.BytesIO(data))
    return data.convert("RGB")


def with_images(messages: list[dict], images: Sequence[Any]) -> list[dict]:
    """The messages with each empty image placeholder filled, in order, by the next image."""
    pictures = iter(open_image(i) for i in images)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": next(pictures)}
                if part["type"] == "image" and "image" not in part
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def prompt_text(messages: list[dict]) -> str:
    """The last user turn's text (its text parts, for a turn with images), as reports show the prompt."""
    content = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    if isinstance(content, str):
        return content
    return " ".join(p["text"] for p in content if p["type"] == "text")


def rendered(
    processor: Any,
    conversations: Sequence[list[dict]],
    images: Sequence[Sequence[Any]],
    *,
    with_labels: bool = False,
    add_generation_prompt: bool = False,
    padding_side: str = "right",
) -> Any:
    """The processor's batch (input_ids, attention_mask, pixel values ...) for conversations with their images;
    with `labels` (assistant text only, padding and image tokens -100) when asked."""
    filled = [with_images(m, imgs) for m, imgs in zip(conversations, images)]
    out = processor.apply_chat_template(
        filled,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        add_generation_prompt=add_generation_prompt,
        return_assistant_tokens_mask=with_labels,
        processor_kwargs={"padding": True, "padding_side": padding_side, "add_special_tokens": False},
    )
    if with_labels:
        labels = out["input_ids"].clone()
        labels[out["attention_mask"] == 0] = IGNORE_INDEX
        labels[out.pop("assistant_masks") == 0] = IGNORE_INDEX
        out["labels"] = labels
    return out


@dataclass
class VisionCollator:
    """Rows of the data stage's `image_conversations` (messages as JSON text, images) into the processor's
    batch with assistant-only labels, and the batch's real token count for the throughput counter."""

    processor: Any

    def __call__(self, rows: list[dict]) -> dict[str, Any]:
        batch = dict(
            rendered(
                self.processor,
                [json.loads(r["messages"]) for r in rows],
                [r["images"] for r in rows],
                with_labels=True,
            )
        )
        batch[NUM_TOKENS_KEY] = batch["attention_mask"].sum()
        return batch
