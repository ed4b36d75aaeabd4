"""ORPO as an objective: its settings, the pairs laid out for TRL's ORPOTrainer, the plan with no reference
model, its odds-ratio scores, and training on the CPU (one process, bf16) with those scores for base and trained."""

from __future__ import annotations

import json
import math

import pytest
from helpers import child_env, evaluate, plan_for, planned, prepare_run, run_cli, tiny_cfg, write_engine

from finetune.core.errors import ConfigError
from finetune.core.objectives import OBJECTIVES
from finetune.evaluation.odds_scores import OddsRatioScorer, log_odds
from finetune.planner.step import FULL_LOGITS_FP32_COPIES

# ---------------------------------------------------------------- the axis


def test_orpo_composes_with_its_own_settings():
    cfg = tiny_cfg("objective=orpo", "objective.beta=0.25")
    assert cfg.objective.spec is OBJECTIVES["orpo"] and cfg.objective.beta == 0.25
    spec = cfg.objective.spec
    assert (spec.reference, spec.sequences_per_example, spec.full_logits) == ("none", 2, True)
    cfg = tiny_cfg("+recipe=tiny_orpo")
    assert cfg.objective.name == "orpo" and cfg.smoke.sibling == "tiny_orpo"


@pytest.mark.parametrize(
    "override, message",
    [
        ("objective.beta=0", "objective.beta=0.0 must be > 0"),
        ("objective.simpo_gamma=1", "objective.simpo_gamma: unknown key; valid keys: beta, name"),
    ],
)
def test_bad_orpo_settings_are_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        tiny_cfg("objective=orpo", override)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_orpo_setting_on_the_command_line_exits_2_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("objective=orpo", "objective.beta=-1", f"run_dir={run}", "mode=plan", env=child_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("objective.beta=-1.0 must be > 0")
    assert not run.exists()


# ---------------------------------------------------------------- the data, as TRL batches it


def test_a_malformed_pair_is_one_line_exit_2_and_writes_nothing(tmp_path):
    good = {"prompt": "Even or odd: 12", "chosen": "even", "rejected": "odd"}
    lines = [json.dumps(good), json.dumps(good | {"prompt": "Even or odd: 13"}), '{"prompt": "x", "chosen": ']
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    proc = run_cli(
        "objective=orpo", "mode=data", f"data.path={data}", f"run_dir={run}", f"data.cache_dir={tmp_path / 'c'}",
        env=child_env(FINETUNE_CACHE=str(tmp_path / "cache")),
    )  # fmt: skip
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "pairs.jsonl line 3" in last and "\n" not in last
    assert not (run / "data").exists()


def test_pairs_are_laid_out_as_trls_orpo_collator_batches_them():
    from finetune.train.reference_free import PairCollator

    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 8, 9], "rejected_ids": [10]},
        {"prompt_ids": [5], "chosen_ids": [11], "rejected_ids": [12, 13]},
    ]
    batch = PairCollator(pad_token_id=0)(rows)
    assert batch["chosen_input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 11, 0, 0, 0]]
    assert batch["chosen_labels"].tolist() == [[-100, -100, 7, 8, 9], [-100, 11, -100, -100, -100]]
    assert batch["chosen_attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["rejected_input_ids"].tolist() == [[5, 6, 10], [5, 12, 13]]
    assert batch["rejected_labels"].tolist() == [[-100, -100, 10], [-100, 12, 13]]
    assert batch["prompt_input_ids"].tolist() == [[5, 6], [0, 5]]  # prompts padded on the left, as TRL does


# ---------------------------------------------------------------- the plan


def test_orpo_plan_counts_no_reference_and_the_whole_logits_of_both_rows():
    fixed = ("+recipe=llama8b_lora", "train.micro_batch_size=2", "train.activation_checkpointing=true")
    _, orpo = planned(*fixed, "objective=orpo")
    _, dpo = planned(*fixed, "objective=dpo")
    # the same two sequences a pair: the same saved activations; no reference forward, no fused head
    assert orpo.gpu_memory.activations == pytest.approx(dpo.gpu_memory.activations, rel=1e-9)
    assert orpo.gpu_memory.weights == pytest.approx(dpo.gpu_memory.weights)
    assert not orpo.strategy.precompute_reference and not orpo.strategy.chunked_loss
    # 2 pairs = 4 rows of 2,048 tokens; Llama 3.1's 128,256-entry vocabulary; bf16 autocast
    logits = FULL_LOGITS_FP32_COPIES[2] * 4 * 4 * orpo.seq_len * 128_256
    assert orpo.gpu_memory.logits == pytest.approx(logits / 1e9, rel=1e-6)
    assert any("TRL's ORPOTrainer on the whole logits" in r for r in orpo.reasons)


def test_llama8b_orpo_plans_and_fits():
    cfg, plan = planned("+recipe=llama8b_orpo")
    assert cfg.objective.name == "orpo" and plan.fits


# ---------------------------------------------------------------- the scores


def test_odds_ratio_scores_read_mean_log_probabilities():
    assert log_odds(math.log(0.5)) == pytest.approx(0.0)
    assert log_odds(math.log(0.8)) == pytest.approx(math.log(4.0))
    scorer = OddsRatioScorer.__new__(OddsRatioScorer)
    scorer.lengths = [(2, 4), (1, 1)]
    # pair 1: chosen mean log 0.8 (sum over 2 tokens), rejected mean log 0.5; pair 2: chosen log 0.2, rejected log 0.5
    sums = [[2 * math.log(0.8), 4 * math.log(0.5)], [math.log(0.2), math.log(0.5)]]
    s = scorer.scores(sums)
    assert s["odds_ratio_accuracy"] == 0.5 and s["pairs"] == 2
    assert s["log_odds_ratio"] == pytest.approx((math.log(4.0) + math.log(0.25)) / 2)
    assert s["chosen_logprob"] == pytest.approx((math.log(0.8) + math.log(0.2)) / 2)


# ---------------------------------------------------------------- training


@pytest.mark.slow
def test_orpo_trains_the_tiny_model_in_bf16_and_scores_base_and_trained(tmp_path, tiny_cache):
    from finetune.data import stage as data_stage
    from finetune.pipeline.stages import resolve
    from finetune.train import stage

    cfg = tiny_cfg(
        "objective=orpo",
        "method.precision=bf16",
        "train.seq_len=64",
        "train.max_steps=3",
        "train.logging_steps=1",
        "train.save_steps=1000",
        "train.warmup_ratio=0.0",
        "method.learning_rate=1e-3",
        f"data.cache_dir={tmp_path / 'cache'}",
        run_dir=tmp_path / "run",
    )
    run = prepare_run(cfg)
    train, evals = data_stage.load_prepared(run)
    cfg = resolve(cfg)
    plan = plan_for(cfg, micro_batch_size=4, grad_accum_steps=1)
    write_engine(cfg, plan, run)
    held_out = evals.select(range(8))
    metrics = stage.run(cfg, run, plan, datasets=(train.select(range(12)), held_out))
    # TRL's maps ran in memory: nothing written beside the prepared rows
    assert sorted(p.name for p in (run / "data" / "train").iterdir()) == [
        "data-00000-of-00001.arrow",
        "dataset_info.json",
        "state.json",
    ]

    t = metrics["train"]
    assert t["steps"] == 3 and math.isfinite(t["final_loss"])
    assert t["engine"]["world_size"] == 1 and t["engine"]["mixed_precision"] == "bf16"
    orpo = t["orpo"]
    assert orpo["logged_steps"] == 3 and set(orpo) >= {"nll_loss", "log_odds", "accuracy"}
    assert orpo["nll_loss"]["last"] < orpo["nll_loss"]["first"]  # the NLL term learns the chosen answers

    scores = evaluate(cfg, run, held_out, 2)
    base, trained = scores["base"], scores["trained"]
    for s in (base, trained):
        assert s["pairs"] == 8 and 0.0 <= s["odds_ratio_accuracy"] <= 1.0
    assert trained["chosen_logprob"] > base["chosen_logprob"]
    ev = json.loads((run / "eval" / "metrics.json").read_text())
    assert ev["trained"]["log_odds_ratio"] == pytest.approx(trained["log_odds_ratio"])
