"""The tiny model, its tokenizer, the bundled data set and its metric."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from finetune.core import tasks
from finetune.modeling import tiny

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- bundled data


def test_bundled_file_is_what_the_script_generates(tmp_path):
    out = tmp_path / "chat.jsonl"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_bundled_data.py"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == tiny.bundled_data_path().read_bytes()
    assert tasks.generate(50, 7) == tasks.generate(50, 7) != tasks.generate(50, 8)


def test_bundled_rows_are_valid_and_answers_correct():
    rows = [json.loads(line) for line in tiny.bundled_data_path().read_text().splitlines()]
    assert 2000 <= len(rows) <= 5000
    counts: dict[str, int] = {}
    for row in rows:
        msgs = row["messages"]
        roles = [m["role"] for m in msgs]
        assert roles in (["user", "assistant"], ["system", "user", "assistant"])
        prompt, answer = msgs[-2]["content"], msgs[-1]["content"]
        kind = tasks.task_of(prompt)
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "parity":
            number = re.fullmatch(r"\D*?(\d+)", prompt).group(1)  # the number ends the prompt
            assert answer == ("even" if int(number) % 2 == 0 else "odd")
        elif kind == "sentiment":
            words = set(re.findall(r"[a-z]+", prompt.lower()))
            pos, neg = words & set(tasks.POSITIVE_WORDS), words & set(tasks.NEGATIVE_WORDS)
            assert len(pos | neg) == 1 and answer == ("positive" if pos else "negative")
        else:
            pytest.fail(f"unknown task: {prompt!r}")
    assert set(counts) == set(tasks.TASK_NAMES) and min(counts.values()) >= len(rows) / 3
    assert len({r["messages"][-2]["content"] for r in rows}) == len(rows)  # distinct prompts


def test_metric():
    assert tasks.exact_match(" Odd.", "odd") and not tasks.exact_match("odd even", "odd")
    prompts = ["Even or odd: 3", "Sentiment: The meal was bad.", "hello"]
    s = tasks.score(prompts, ["odd", "good", "x"], ["odd", "negative", "x"])
    assert s["exact_match"] == pytest.approx(2 / 3)
    assert (
        s["exact_match_parity"] == 1.0 and s["exact_match_sentiment"] == 0.0 and s["exact_match_other"] == 1.0
    )
    assert tasks.score(["hello"], ["x"], ["y"]) == {"exact_match": 0.0}
    for t in tasks.PARITY_TEMPLATES:
        assert tasks.task_of(t.format(n=12)) == "parity"
    for t in tasks.SENTIMENT_TEMPLATES:
        assert tasks.task_of(t.format(x="The show was fun.")) == "sentiment"


# ---------------------------------------------------------------- tokenizer


def test_tokenizer(tiny_tokenizer, tiny_model_cfg):
    tok = tiny_tokenizer
    assert len(tok) <= tiny_model_cfg.vocab_size
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (tiny.PAD, tiny.BOS, tiny.EOS)
    assert tok.pad_token_id != tok.eos_token_id
    assert "{% generation %}" in tok.chat_template
    ids = tok("4817", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["4", "8", "1", "7"]  # digits one per token
    msgs = [
        {"role": "system", "content": "Reply with the answer only."},
        {"role": "user", "content": "Even or odd: 4817"},
        {"role": "assistant", "content": "odd"},
    ]
    enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    labelled = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(labelled) == "odd" + tiny.EOS  # the answer and the end-of-turn token carry the loss
    prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|assistant|>\n")
    assert tok.decode(tok(prompt, add_special_tokens=False)["input_ids"]) == prompt


# ---------------------------------------------------------------- model


def test_model_is_cached_seeded_and_loads_like_a_hub_model(tiny_cache, tiny_model_cfg, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (tiny_model_dir / "model.safetensors").is_file() and (tiny_model_dir / "config.json").is_file()
    mtime = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    a = tiny.load_model(tiny_model_cfg)
    assert tiny.model_dir(tiny_model_cfg) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    b = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert type(a).__name__ == "LlamaForCausalLM"
    c = a.config
    assert (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
    ) == (
        tiny_model_cfg.hidden_size,
        tiny_model_cfg.num_layers,
        tiny_model_cfg.num_heads,
        tiny_model_cfg.num_kv_heads,
        tiny_model_cfg.vocab_size,
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert c.eos_token_id == tok.eos_token_id and c.pad_token_id == tok.pad_token_id
    assert (
        a.dtype == torch.float32 and tiny.load_model(tiny_model_cfg, torch.bfloat16).dtype == torch.bfloat16
    )


def test_other_dims_build_elsewhere_and_same_seed_same_weights(
    tiny_cache, tiny_model_cfg, tmp_path, monkeypatch
):
    import torch

    small = replace(tiny_model_cfg, hidden_size=32, head_dim=8, intermediate_size=64, num_layers=1)
    first = tiny.model_dir(small)
    assert first != tiny.model_dir(tiny_model_cfg)
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path))
    second = tiny.model_dir(small)
    assert second != first
    a = tiny.load_model(small)
    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_cache))
    b = tiny.load_model(small)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
