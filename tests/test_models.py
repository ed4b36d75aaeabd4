"""The one model and tokenizer loader (finetune/modeling/models.py): what it gives every stage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.core.errors import DataError
from finetune.modeling import models
from finetune.modeling.collator import PackedCollator


def _saved_without_pad(tokenizer, path, *, drop_eos: bool = False):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.pad_token = None
    if drop_eos:
        tok.eos_token = None
    tok.save_pretrained(str(path))
    return path


def test_a_tokenizer_without_pad_pads_with_eos_as_trl_does(tmp_path, tiny_tokenizer, tiny_model_cfg):
    # Llama 3.x tokenizers ship no pad token: the collator needs an id to pad with.
    folder = _saved_without_pad(tiny_tokenizer, tmp_path / "tok")
    tok = models.load_tokenizer(replace(tiny_model_cfg, name="nopad", hub_id=str(folder)))
    assert tok.pad_token == tok.eos_token == tiny_tokenizer.eos_token
    assert tok.pad_token_id == tiny_tokenizer.eos_token_id

    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    batch = PackedCollator(pad_token_id=tok.pad_token_id)(rows)
    assert batch["input_ids"][1].tolist() == [8, 9, tok.eos_token_id]
    assert batch["labels"][1].tolist() == [-100, 9, -100]  # padding never enters the loss


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused_in_one_line(
    tmp_path, tiny_tokenizer, tiny_model_cfg
):
    folder = _saved_without_pad(tiny_tokenizer, tmp_path / "tok", drop_eos=True)
    with pytest.raises(DataError, match=r"neither a pad nor an eos token") as err:
        models.load_tokenizer(replace(tiny_model_cfg, name="nopad", hub_id=str(folder)))
    assert "\n" not in str(err.value)
