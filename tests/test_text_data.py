"""Data as users bring it: plain `text` records (every token trained, no chat template), columns named
otherwise (the error names data.prompt_field / data.completion_field), the detected format recorded, and
hub data sets read at data.split, data.subset and data.revision."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from finetune.core.config import Config, TrainConfig
from finetune.core.config.data import DataConfig
from finetune.core.errors import DataError
from finetune.data import render, sources, stage
from finetune.data.formats import TEXT_ROLE, to_messages

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "over",
    "hills",
    "and",
    "birds",
    "sang",
    "old",
    "songs",
]


def _texts(n: int) -> list[dict]:
    return [
        {"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(10 + i % 7)) + f" {i}"} for i in range(n)
    ]


def _cfg(tmp_path: Path, path: Path, **data) -> Config:
    data.setdefault("cache_dir", str(tmp_path / "cache"))
    return Config(data=DataConfig(path=str(path), **data), train=TrainConfig(seq_len=128))


def test_a_text_record_trains_every_token_and_ends_with_eos(tiny_tokenizer) -> None:
    msgs = to_messages({"text": "the cat sat"}, DataConfig())
    assert msgs == [{"role": TEXT_ROLE, "content": "the cat sat"}]
    # a system prompt is for conversations, not plain text
    assert to_messages({"text": "x y"}, DataConfig(system_prompt="be brief")) == [
        {"role": TEXT_ROLE, "content": "x y"}
    ]
    renderer = render.Renderer(tiny_tokenizer)
    (ids,), (labels,) = renderer.encode([msgs])
    plain = tiny_tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tiny_tokenizer.eos_token_id and ids[-1 - len(plain) : -1] == plain
    assert labels == ids  # every token a label (the first is never a target once shifted)


def test_text_data_needs_no_chat_template(tiny_tokenizer, tmp_path: Path) -> None:
    base = copy.deepcopy(tiny_tokenizer)
    base.chat_template = None
    renderer = render.Renderer(base)
    (ids,), (labels,) = renderer.encode([[{"role": TEXT_ROLE, "content": "a mat"}]])
    assert labels == ids
    with pytest.raises(DataError, match="no chat template.*data.format=text"):
        renderer.encode([[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]])


def test_the_data_stage_on_text_records(tiny_tokenizer, tmp_path: Path, capsys) -> None:
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _texts(40)))
    s = stage.run(_cfg(tmp_path, path, eval_fraction=0.1), tmp_path / "run", tokenizer=tiny_tokenizer)
    assert s["formats"] == {"text": 40}
    assert json.loads((tmp_path / "run" / "data_stats.json").read_text())["formats"] == {"text": 40}
    # every token of every sample is trained but each sample's first, which nothing precedes
    assert s["trainable_tokens"]["train"] == s["tokens"]["train_total"] - s["splits"]["train"]["count"]
    assert s["trainable_tokens"]["eval"] == s["tokens"]["eval_total"] - s["splits"]["eval"]["count"]
    assert "data: 40 input (text 40)" in capsys.readouterr().err


def test_mixed_formats_are_counted(tiny_tokenizer, tmp_path: Path) -> None:
    rows = _texts(10) + [{"prompt": f"q {i}", "completion": f"a {i}"} for i in range(10)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = stage.run(_cfg(tmp_path, path, eval_fraction=0.1), tmp_path / "run", tokenizer=tiny_tokenizer)
    assert s["formats"] == {"prompt_completion": 10, "text": 10}


def test_csv_columns_named_otherwise_name_the_field_settings(tiny_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "qa.csv"
    path.write_text("question,answer\n" + "".join(f"what is {i} plus one?,{i + 1}\n" for i in range(20)))
    with pytest.raises(DataError) as exc:
        stage.run(_cfg(tmp_path, path), tmp_path / "run", tokenizer=tiny_tokenizer)
    line = str(exc.value)
    assert (
        f"{path} line 2: no 'messages', 'prompt'+'completion', 'instruction'+'output' or 'text' field" in line
    )
    assert (
        "(fields: answer, question); name yours with data.prompt_field=question data.completion_field=answer"
        in line
    )
    s = stage.run(
        _cfg(tmp_path, path, prompt_field="question", completion_field="answer"),
        tmp_path / "run",
        tokenizer=tiny_tokenizer,
    )
    assert s["formats"] == {"prompt_completion": 20} and s["num_input"] == 20


def test_a_forced_format_names_the_setting_of_the_missing_field() -> None:
    from finetune.data.formats import RecordError

    with pytest.raises(RecordError, match=r"missing field 'answer' \(data.completion_field=answer;"):
        to_messages({"prompt": "p"}, DataConfig(format="prompt_completion", completion_field="answer"))
    with pytest.raises(RecordError, match=r"missing field 'body' \(data.text_field=body;"):
        to_messages({"text": "p"}, DataConfig(format="text", text_field="body"))


def test_a_saved_dataset_is_read_at_data_split(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(3)
    ]
    folder = tmp_path / "ultra"
    DatasetDict({"train_sft": Dataset.from_list(rows), "test_sft": Dataset.from_list(rows[:1])}).save_to_disk(
        folder
    )
    inp, _ = sources.open_input(str(folder), data=DataConfig(split="train_sft"))
    assert len(inp.dataset) == 3
    inp, _ = sources.open_input(str(folder), data=DataConfig(split="test_sft"))
    assert len(inp.dataset) == 1
    with pytest.raises(DataError, match=r"no split data.split=train \(splits: train_sft, test_sft\)"):
        sources.open_input(str(folder))


def test_a_hub_data_set_is_loaded_at_its_split_subset_and_revision(monkeypatch) -> None:
    import datasets

    calls = []

    def load_dataset(name, subset=None, **kwargs):
        calls.append((name, subset, kwargs))
        if kwargs["split"] == "nope":
            raise ValueError("Unknown split \"nope\". Should be one of ['train_sft'].")
        return datasets.Dataset.from_list([{"text": "a"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    data = DataConfig(split="train_sft", subset="default", revision="abc123")
    inp, fp = sources.open_input("Org/chats", data=data)
    assert calls == [("Org/chats", "default", {"split": "train_sft", "revision": "abc123"})]
    assert len(inp.dataset) == 1
    other, _ = sources.open_input("Org/chats", data=DataConfig(split="train_sft", subset="default"))
    assert fp != _  # another revision is another input
    with pytest.raises(DataError, match=r"^data.split: the hub data set data.path=Org/chats .*Unknown split"):
        sources.open_input("Org/chats", data=DataConfig(split="nope"))
