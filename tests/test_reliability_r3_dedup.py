"""A held-out prompt never reaches training, however it is restated: under another system prompt, in other
spacing or case, with another answer. The train/eval split compares prompts by their user turns
(`clean.prompt_key`), for SFT conversations, DPO pairs and GRPO prompts alike."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import tiny_cfg

from finetune.core.config import Config, TrainConfig
from finetune.core.config.data import DataConfig
from finetune.data import clean, pairs, preferences, samples, sources, stage, synthetic

SYSTEM = "You are a terse assistant. Answer in one line."


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic.build_tokenizer(
        synthetic.corpus_of(synthetic.conversations(60, seed=9, median_words=15)),
        synthetic.LLAMA3,
        vocab_size=400,
    )


def _restated(conv: list[dict]) -> list[dict]:
    """The same questions under another system prompt, upper-cased and re-spaced, with another last answer."""
    out = [{"role": "system", "content": SYSTEM}]
    for m in conv:
        if m["role"] == "system":
            continue
        if m["role"] == "user":
            out.append({"role": "user", "content": "  " + "\n ".join(m["content"].upper().split()) + " "})
        else:
            out.append(dict(m))
    out[-1] = {"role": "assistant", "content": out[-1]["content"] + " Something else entirely, then."}
    return out


def _conversations(n: int) -> list[list[dict]]:
    """`n` conversations (distinct questions) and each one restated (`_restated`), interleaved."""
    originals = synthetic.conversations(n, seed=21, median_words=12, sigma=0.5)
    return [c for conv in originals for c in (conv, _restated(conv))]


def test_prompt_key_is_the_user_turns_whatever_the_system_prompt_or_spacing():
    conv = synthetic.conversations(1, seed=3, median_words=10)[0]
    assert clean.prompt_key(_restated(conv)) == clean.prompt_key(conv)
    assert clean.conversation_key(_restated(conv)) != clean.conversation_key(conv)
    assert clean.prompt_key([{"role": "user", "content": "What is 2+2?"}]) == "user: what is 2+2?"
    # no user turn: keyed by the whole conversation, never by an empty prompt shared with every such sample
    text = [{"role": "assistant", "content": "Once upon a time"}]
    assert clean.prompt_key(text) == clean.conversation_key(text) == "assistant: once upon a time"


def test_sft_train_keeps_no_restated_eval_prompt(tmp_path, tokenizer):
    convs = _conversations(40)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = Config(
        data=DataConfig(
            path=str(path), cache_dir=str(tmp_path / "cache"), near_dedup=False, eval_fraction=0.3
        ),
        train=TrainConfig(seq_len="auto"),
    )
    result = stage.run(cfg, tmp_path / "run", tokenizer=tokenizer)
    _, evals = stage.load_prepared(tmp_path / "run")
    eval_prompts = {clean.prompt_key(json.loads(m)) for m in evals["messages"]}
    assert result["num_eval"] == len(evals) == 24  # round(0.3 * 80)
    # Held out by prompt: a conversation and its restatement go to one side together, but for the one pair the
    # cut falls between, whose train side is dropped as a leak.
    asked = [clean.prompt_key(c) in eval_prompts for c in convs]
    leaked = sum(asked) - result["num_eval"]
    assert leaked == 0 and result["dropped"] == {}
    assert result["num_train"] == len(convs) - 24
    # the cut between a twin pair (an odd number held out): its train twin is dropped
    cut = []
    for seed in range(1, 4):
        cfg = replace(cfg, data=replace(cfg.data, eval_fraction=0.3125))  # 25 of 80
        again = stage.run(
            replace(cfg, data=replace(cfg.data, seed=seed)), tmp_path / f"run{seed}", tokenizer=tokenizer
        )
        _, evals = stage.load_prepared(tmp_path / f"run{seed}")
        eval_prompts = {clean.prompt_key(json.loads(m)) for m in evals["messages"]}
        leaked = sum(clean.prompt_key(c) in eval_prompts for c in convs) - again["num_eval"]
        assert again["dropped"] == ({"eval_leak": leaked} if leaked else {})
        assert again["num_train"] == len(convs) - again["num_eval"] - leaked
        cut.append(leaked)
    assert cut == [1, 1, 1]


def test_grpo_train_prompts_hold_no_restated_eval_prompt(tmp_path, tokenizer):
    convs = _conversations(30)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cfg = tiny_cfg(
        "objective=grpo",
        "objective.num_generations=4",
        f"data.path={path}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.near_dedup=false",
        "data.eval_fraction=0.3",
        "train.seq_len=512",
    )
    result = stage.run(cfg, tmp_path / "run", tokenizer=tokenizer)
    train, evals = stage.load_prepared(tmp_path / "run")
    eval_prompts = {clean.prompt_key(json.loads(m)) for m in evals["messages"]}
    train_prompts = [clean.prompt_key(p) for p in train["prompt"]]
    assert len(evals) == 18 and len(train) == result["num_train"] > 0
    assert not eval_prompts & set(train_prompts)
    assert result["num_train"] + 18 + result["dropped"].get("eval_leak", 0) == len(convs)


def test_dpo_pairs_of_one_prompt_restated_follow_it_to_one_side(tmp_path):
    dc = DataConfig(eval_fraction=0.25, seed=3)
    kept = []
    for i in range(20):
        question = f"How many legs does animal number {i} have?"
        kept.append(pairs.Pair([{"role": "user", "content": question}], _answer("four"), _answer("six")))
        restated = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f" {question.lower()}  "},
        ]
        kept.append(pairs.Pair(restated, _answer("Four legs."), _answer("Eight.")))
    tally = samples.Tally()
    train, evals = _split_pairs(kept, dc, tally, tmp_path)
    train_prompts = {clean.prompt_key(p.prompt) for p in train}
    eval_prompts = {clean.prompt_key(p.prompt) for p in evals}
    assert len(eval_prompts) == 5 and len(evals) == 10  # both pairs of each held-out prompt
    assert len(train) == 30 and not train_prompts & eval_prompts
    assert tally.dropped["eval_leak"] == 0  # nothing needed dropping: the twins were split together


def _split_pairs(
    kept: list[pairs.Pair], dc: DataConfig, tally: samples.Tally, scratch: Path
) -> tuple[list[pairs.Pair], list[pairs.Pair]]:
    """(train, eval) pairs as the data stage splits them: streamed by prompt (`samples.split_by_prompt`)."""
    records = [
        sources.Record("p.jsonl", i + 1, {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected})
        for i, p in enumerate(kept)
    ]

    def to_samples(data: dict) -> list[samples.Candidate]:
        p = pairs.to_pair(data, dc)
        return [
            (
                json.dumps([p.prompt, p.chosen, p.rejected]),
                preferences._pair_key(p),
                clean.prompt_key(p.prompt),
            )
        ]

    found = samples.collect(records, sources.Loaded(), dc, tally, scratch, to_samples, by_prompt=True)
    train_rows, eval_rows = samples.split_by_prompt(found, dc, tally)
    try:
        return tuple(  # type: ignore[return-value]
            [pairs.Pair(*json.loads(t)) for t in found.store.texts(rows)] for rows in (train_rows, eval_rows)
        )
    finally:
        found.close()


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_a_near_restated_dpo_prompt_is_an_eval_leak(tmp_path):
    """Beyond spacing and case: one word added to a long question under another system prompt. Of the two
    prompts one is held out; the other is its near duplicate and never trains."""
    dc = DataConfig(eval_fraction=0.5, seed=0)
    words = " ".join(f"word{i}" for i in range(60))
    kept = [
        pairs.Pair([{"role": "user", "content": f"{words} first"}], _answer("a"), _answer("b")),
        pairs.Pair(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{words} first please"}],
            _answer("c"),
            _answer("d"),
        ),
    ]
    tally = samples.Tally()
    train, evals = _split_pairs(kept, dc, tally, tmp_path)
    assert len(evals) == 1 and train == [] and +tally.dropped == {"eval_leak": 1}
