"""KTO as an objective: its settings, the `labelled` record kind through the data stage, the bundled set, TRL's KL
pairing, the planner's terms for its four forwards, and its implicit-reward scores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import REPO, child_env, run_cli, tiny_cfg

from finetune.core.config.data import DataConfig
from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES
from finetune.data import labelled
from finetune.data.formats import RecordError

# ---------------------------------------------------------------- the axis


def test_objective_group_and_settings_compose():
    from finetune.core.config.kto import KTOObjective

    cfg = tiny_cfg("objective=kto", "objective.beta=0.2", "objective.desirable_weight=1.33")
    assert cfg.objective == KTOObjective(beta=0.2, desirable_weight=1.33)
    assert cfg.objective.spec is OBJECTIVES["kto"] and cfg.objective.spec.record_kind == "labelled"
    assert cfg.objective.spec.eval_metrics[:2] == ("desirable_margin", "separation_accuracy")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("objective.beta=0",), "objective.beta=0.0 must be > 0"),
        (
            ("objective.loss_type=sigmoid",),
            "objective.loss_type='sigmoid' is not one of kto, apo_zero_unpaired",
        ),
        (("objective.undesirable_weight=-1",), "objective.undesirable_weight=-1.0 must be > 0"),
        # the KL estimate pairs each prompt with another example's completion in the same micro-batch
        (
            ("train.micro_batch_size=1",),
            "train.micro_batch_size=1: objective=kto needs at least 2 examples a",
        ),
        (
            ("train.batch_size=1",),
            "train.batch_size=1: objective=kto needs at least 2 examples a micro-batch",
        ),
    ],
)
def test_bad_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        tiny_cfg("objective=kto", *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_recipes_compose():
    from finetune.core.composition import compose

    tiny = compose(["+recipe=tiny_kto"])
    assert tiny.objective.name == "kto" and tiny.smoke.sibling == "tiny_kto" and tiny.method.name == "lora"
    big = compose(["+recipe=llama8b_kto"])
    assert big.objective.name == "kto" and big.model.name.startswith("llama3_1_8b")


# ---------------------------------------------------------------- labelled records

DC = DataConfig()
USER = {"role": "user", "content": "Even or odd: 12"}


def test_record_shapes_map_to_examples():
    (plain,) = labelled.to_examples({"prompt": "Even or odd: 12", "completion": "even", "label": True}, DC)
    assert plain.prompt == [USER] and plain.completion == [{"role": "assistant", "content": "even"}]
    assert plain.label is True
    chat = {"prompt": [USER], "completion": [{"role": "assistant", "content": "odd"}], "label": 0}
    assert labelled.to_examples(chat, DC)[0].label is False
    # a preference pair is two examples, as TRL unpairs it
    good, bad = labelled.to_examples({"prompt": "Even or odd: 12", "chosen": "even", "rejected": "odd"}, DC)
    assert (good.label, bad.label) == (True, False) and bad.completion[0]["content"] == "odd"
    named = DataConfig(label_field="good", completion_field="answer")
    assert labelled.to_examples({"prompt": "q?", "answer": "a", "good": False}, named)[0].label is False


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": "q", "completion": "a", "label": "yes"}, "bad_label"),
        ({"prompt": "q", "completion": "a", "label": 2}, "bad_label"),
        ({"prompt": "q", "completion": "a"}, "missing_field"),
        ({"completion": "a", "label": True}, "missing_field"),
        ({"prompt": [{"role": "assistant", "content": "q"}], "completion": "a", "label": True}, "bad_prompt"),
        ({"prompt": "q", "completion": [USER], "label": True}, "bad_answer"),
    ],
)
def test_bad_records_are_refused_with_a_reason(record, reason):
    with pytest.raises(RecordError) as err:
        labelled.to_examples(record, DC)
    assert err.value.reason == reason


def test_bad_label_is_one_line_exit_2_naming_the_key_and_writes_nothing(tmp_path):
    good = {"prompt": "Even or odd: 12", "completion": "even", "label": True}
    data = tmp_path / "kto.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(good | {"label": "maybe"}) + "\n")
    run = tmp_path / "run"
    proc = run_cli(
        "objective=kto", "mode=data", f"data.path={data}", f"run_dir={run}", f"data.cache_dir={tmp_path / 'c'}",
        env=child_env(FINETUNE_CACHE=str(tmp_path / "cache")),
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert (
        "kto.jsonl line 2" in lines[-1]
        and "data.label_field=label" in lines[-1]
        and "1 bad_label" in lines[-1]
    )
    assert not (run / "data_stats.json").exists() and not (run / "data").exists()


def test_data_stage_splits_by_prompt_counts_labels_and_parts_neighbours(tmp_path, tiny_tokenizer):
    from finetune.data import sources

    rows = []
    for n in range(60):
        answer, other = ("even", "odd") if n % 2 == 0 else ("odd", "even")
        prompt = f"Even or odd: {1000 + n * 7919}"
        # a file of unpaired pairs: a prompt's two examples side by side
        rows.append({"prompt": prompt, "completion": answer, "label": True})
        rows.append({"prompt": prompt, "completion": other, "label": False})
    rows.append(rows[0])  # an exact duplicate
    rows.append({"prompt": "Even or odd: 5", "completion": "x" * 5000, "label": True})  # too long
    path = tmp_path / "k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_cfg("objective=kto", "train.seq_len=48", "data.eval_fraction=0.2", "data.near_dedup=false")
    inp, _ = sources.open_input(str(path))
    prepared = labelled.prepare(cfg, tiny_tokenizer, inp, str(path), console=None)
    s = prepared.stats
    assert s["num_input"] == 122 and s["dropped"]["duplicate"] == 1
    assert s["dropped"].get("too_long", 0) + s["dropped"].get("too_long_chars", 0) == 1
    assert (s["num_train"], s["num_eval"]) == (96, 24)  # 12 prompts of 60 held out, both their examples
    assert s["labels"] == {
        "train": {"desirable": 48, "undesirable": 48},
        "eval": {"desirable": 12, "undesirable": 12},
    }

    def prompts(rows):
        return [tuple(r["prompt_ids"]) for r in rows]

    assert not set(prompts(prepared.train)) & set(prompts(prepared.evals))
    # ordered by the seed, not as read: a prompt's two examples are rarely neighbours
    neighbours = sum(a == b for a, b in zip(prompts(prepared.train), prompts(prepared.train)[1:]))
    assert neighbours <= 5, neighbours
    for r in [*prepared.train, *prepared.evals]:
        assert len(r["prompt_ids"]) + len(r["completion_ids"]) <= 48 and r["completion_ids"]
    # generation is scored on the desirable answers; an undesirable row holds its prompt alone
    for r in prepared.evals:
        messages = json.loads(r["messages"])
        assert (messages[-1]["role"] == "assistant") is r["label"]


def test_bundled_set_is_the_pairs_unpaired_one_to_one_and_regenerates():
    import subprocess
    import sys
    import tempfile

    from finetune.modeling.tiny import bundled_data_path

    rows = [json.loads(line) for line in bundled_data_path("labelled").read_text().splitlines()]
    pairs = [json.loads(line) for line in bundled_data_path("preferences").read_text().splitlines()]
    assert len(rows) == 2 * len(pairs) == 2400
    assert sum(r["label"] for r in rows) == 1200  # the pairs' ratio: one desirable to one undesirable
    answers = {json.dumps(p["prompt"]): (p["chosen"], p["rejected"]) for p in pairs}
    for r in rows:
        chosen, rejected = answers[json.dumps(r["prompt"])]
        assert r["completion"] == (chosen if r["label"] else rejected)
    # shuffled: neighbours hold different prompts
    assert sum(a["prompt"] == b["prompt"] for a, b in zip(rows, rows[1:])) < 10
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "l.jsonl"
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "make_bundled_labelled.py"), "--out", str(out)],
            check=True, capture_output=True, text=True, env=child_env(),
        )  # fmt: skip
        assert "(1200 desirable, 1200 undesirable)" in proc.stdout
        assert out.read_bytes() == bundled_data_path("labelled").read_bytes()


# ---------------------------------------------------------------- TRL's KL pairing and the weights


def test_kl_pairs_rotate_each_micro_batch_as_trl_does():
    from datasets import Dataset

    from finetune.train.kto_trainer import with_kl_pairs

    ds = Dataset.from_dict(
        {
            "prompt_ids": [[i] for i in range(5)],
            "completion_ids": [[10 + i] for i in range(5)],
            "label": [True] * 5,
        }
    )
    kl = with_kl_pairs(ds, micro_batch_size=2)["KL_completion_ids"]
    # (x1, y2), (x2, y1) | (x3, y4), (x4, y3) | (x5, y5): the last, lone row is its own pair, as in TRL
    assert kl == [[11], [10], [13], [12], [14]]


def test_weight_advice_follows_the_kto_papers_range():
    from finetune.train.kto_trainer import weight_advice

    assert weight_advice(100, 100, 1.0, 1.0) == ""
    assert weight_advice(100, 80, 1.0, 1.0) == ""  # 1.25: inside [1, 4/3]
    advice = weight_advice(100, 300, 1.0, 1.0)  # 1/3: too few desirable examples for equal weights
    assert "objective.desirable_weight in [3.00, 3.99]" in advice
    assert "objective.undesirable_weight in [0.25, 0.33]" in advice
    assert weight_advice(100, 300, 3.0, 1.0) == ""


def test_trl_config_carries_the_settings(tmp_path):
    import torch
    from helpers import planned, write_engine

    from finetune.train import kto_trainer

    cfg, plan = planned("+recipe=tiny_kto", "objective.desirable_weight=1.2", "objective.beta=0.3")
    run = tmp_path / "run"
    run.mkdir()
    write_engine(cfg, plan, run)
    args = kto_trainer.build_config(cfg, plan, run, torch.float32)
    assert (args.beta, args.desirable_weight, args.undesirable_weight, args.loss_type) == (
        0.3,
        1.2,
        1.0,
        "kto",
    )
    assert args.per_device_train_batch_size == 32 and args.train_sampling_strategy == "sequential"
    assert not args.precompute_ref_log_probs and args.max_length is None


# ---------------------------------------------------------------- the plan


def _plans(*overrides: str, precompute=None):
    from finetune.core.composition import compose, load_profiles
    from finetune.planner import make_plan

    cfg = compose(list(overrides))
    return {
        name: make_plan(
            cfg.model,
            cfg.method,
            cfg.hardware,
            cfg.train,
            cfg.plan,
            load_profiles(),
            objective=OBJECTIVES[name],
            precompute_reference=precompute,
        )  # fmt: skip
        for name in ("sft", "kto")
    }


def test_plan_counts_one_sequence_an_example_and_four_forwards():
    from finetune.planner.job import make_job
    from finetune.planner.timing import executed_flops_per_token

    fixed = ("+recipe=llama8b_lora", "train.micro_batch_size=2", "train.activation_checkpointing=true",
             "train.chunked_loss=false")  # fmt: skip
    p = _plans(*fixed)
    sft, kto = p["sft"], p["kto"]
    assert kto.strategy == sft.strategy
    # one trained sequence an example: SFT's activations; the reference's transient forward on top of the loss
    assert kto.gpu_memory.activations == pytest.approx(sft.gpu_memory.activations, rel=1e-9)
    assert kto.gpu_memory.logits > sft.gpu_memory.logits
    assert kto.gpu_memory.weights == pytest.approx(sft.gpu_memory.weights)  # adapters: no reference copy
    # the time: three forwards under no_grad a trained token (the policy's KL pair, the reference on both)
    from finetune.core.composition import compose

    cfg = compose(list(fixed))
    jobs = {
        n: make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, kto.seq_len, objective=OBJECTIVES[n])
        for n in ("sft", "kto")
    }
    m = cfg.model
    forward = 2.0 * jobs["kto"].counts.linear + 2.0 * m.num_layers * kto.seq_len * m.num_heads * m.head_dim
    extra = executed_flops_per_token(jobs["kto"], kto.strategy) - executed_flops_per_token(
        jobs["sft"], sft.strategy
    )
    assert extra == pytest.approx(3 * forward, rel=1e-12)
    assert kto.estimate.step_seconds / sft.estimate.step_seconds == pytest.approx(
        executed_flops_per_token(jobs["kto"], kto.strategy)
        / executed_flops_per_token(jobs["sft"], sft.strategy)
    )


def test_plan_never_halves_below_two_examples():
    # 128k tokens a row: SFT's search goes down to one row a micro-batch; KTO's stops at two
    long = ("+recipe=llama8b_lora", "train.seq_len=32768", "hardware=h200")
    p = _plans(*long)
    assert p["sft"].strategy.micro_batch_size == 1
    assert p["kto"].strategy.micro_batch_size == 2


def test_full_fine_tuning_precomputes_both_reference_forwards_once_an_epoch():
    from finetune.core.composition import compose
    from finetune.planner.job import make_job
    from finetune.planner.timing import reference_flops_per_token

    base = ("+recipe=llama70b_full", "hardware=h100x8", "train.micro_batch_size=2", "train.sharding=zero3",
            "train.offload_params=false", "train.offload_optimizer=true", "train.epochs=2")  # fmt: skip
    copy = _plans(*base, precompute=False)["kto"]
    pre = _plans(*base, precompute=True)["kto"]
    extra = copy.gpu_memory.weights - pre.gpu_memory.weights
    assert extra == pytest.approx(2 * copy.params_total / 8 / 1e9, rel=0.02)  # the frozen bf16 copy, sharded
    cfg = compose(list(base))
    job = make_job(cfg.model, cfg.method, cfg.hardware, cfg.train, copy.seq_len, objective=OBJECTIVES["kto"])
    m = cfg.model
    forward = 2.0 * job.counts.linear + 2.0 * m.num_layers * copy.seq_len * m.num_heads * m.head_dim
    assert reference_flops_per_token(job, copy.strategy) == pytest.approx(3 * forward)
    # precomputed: the reference's two forwards once an epoch (two epochs), the policy's KL forward every step
    assert reference_flops_per_token(job, pre.strategy) == pytest.approx(forward + 2 * forward / 2)


# ---------------------------------------------------------------- the scores


def test_scores_by_implicit_reward():
    from finetune.evaluation import kto_scores

    ref = [-5.0, -5.0, -3.0, -2.0]
    labels = [True, False, True, False]
    same = kto_scores.scores(ref, ref, labels, beta=0.1)
    # the reference against itself: every reward 0, no pair separated
    assert same["desirable_margin"] == 0.0 and same["separation_accuracy"] == 0.0
    assert same["logprob_separation"] == 0.25  # -3 > -5 of the (desirable, undesirable) pairs' four
    policy = [-4.0, -6.0, -2.0, -4.0]  # desirable up 1 each, undesirable down 1 and 2
    better = kto_scores.scores(policy, ref, labels, beta=0.5)
    assert better["reward_desirable"] == pytest.approx(0.5)
    assert better["reward_undesirable"] == pytest.approx(-0.75)
    assert better["desirable_margin"] == pytest.approx(1.25)
    assert better["separation_accuracy"] == 1.0 and better["examples"] == 4
    assert set(better) - {"examples"} == set(OBJECTIVES["kto"].eval_metrics)
    assert kto_scores.scores([1.0], [0.0], [True], beta=0.1) == {}  # one label only: nothing to separate
    assert math.isclose(kto_scores._separation([1.0, 2.0], [1.0, 0.0]), 3 / 4)  # the tie is not separated
