"""Training through the pipeline with a Ulysses sequence split (DeepSpeed's ALST via accelerate's
`ParallelismConfig(sp_size)`), the chunked loss reading each shard's pre-shifted labels.

The default run checks the pieces in one process: a shard's chunked loss over the whole batch's token
count sums to the whole sequence's, through the model's patched forward too; the collator cuts rows into
equal shards; a Ulysses plan's SFTConfig carries the split; the ring (planned only) is refused in one line.
The extended runs (`python -m pytest -m extended tests/test_sequence_parallel_training.py`, minutes on 2
cores) train the tiny model on two CPU ranks (torchrun, gloo, ZeRO-3) with and without the split and
compare the losses and the first step's gradient norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import SEQ_LEN, losses, planned, run_modes

from finetune.launch.engines import write_engine_files
from finetune.modeling.chunked_loss import IGNORE_INDEX, add_chunked_loss_head, chunked_causal_lm_loss
from finetune.modeling.collator import NUM_TOKENS_KEY, PackedCollator

ULYSSES = (
    "hardware.gpus_per_node=2", "train.sharding=zero3", "train.sequence_parallel=2",
    "train.sequence_split=ulysses", "data.packing=false", SEQ_LEN,
)  # fmt: skip


def _shift(labels: torch.Tensor) -> torch.Tensor:
    """What deepspeed's UlyssesSPDataLoaderAdapter does to the whole row before it cuts it."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def test_shard_losses_over_the_whole_count_sum_to_the_whole_sequence_loss():
    torch.manual_seed(0)
    hidden = torch.randn(2, 16, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 32, (2, 16))
    labels[:, :3] = IGNORE_INDEX  # a prompt
    whole = chunked_causal_lm_loss(hidden, weight, labels, chunk_size=5)
    whole.backward()
    g_hidden, g_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    shifted = _shift(labels)
    count = (shifted != IGNORE_INDEX).sum()  # every shard's tokens: what _get_num_items_in_batch returns
    shards = [
        chunked_causal_lm_loss(hidden[:, i : i + 8], weight, None, shift_labels=shifted[:, i : i + 8],
                               num_items_in_batch=count, chunk_size=5)
        for i in (0, 8)
    ]  # fmt: skip
    # a shard's last token predicts the next shard's first: the pre-shifted labels keep that token's loss
    assert (shifted[:, 7] != IGNORE_INDEX).all()
    total = shards[0] + shards[1]
    assert total.item() == pytest.approx(whole.item(), rel=1e-12)
    total.backward()
    assert torch.allclose(hidden.grad, g_hidden, rtol=1e-10)
    assert torch.allclose(weight.grad, g_weight, rtol=1e-10)


def test_the_patched_forward_reads_shift_labels(tiny_model_cfg, tiny_cache):
    from finetune.modeling import tiny

    torch.manual_seed(0)
    model = add_chunked_loss_head(tiny.load_model(tiny_model_cfg).float().eval())
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad():
        by_labels = model(input_ids=ids, labels=ids, chunked_loss=True).loss
        by_shift = model(input_ids=ids, shift_labels=_shift(ids), chunked_loss=True).loss
        plain = model(input_ids=ids, labels=ids).loss  # transformers' own loss
    assert float(by_shift) == pytest.approx(float(by_labels), rel=1e-6)
    assert float(by_shift) == pytest.approx(float(plain), rel=1e-5)


def test_the_collator_cuts_rows_into_equal_shards_and_counts_tokens_as_an_int():
    rows = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
        {"input_ids": [8, 9, 10, 11, 12], "labels": [8] * 5},
    ]
    batch = PackedCollator(pad_token_id=0, pad_to_multiple_of=2)(rows)
    assert batch["input_ids"].shape == (2, 6) and batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2]
    # an int: deepspeed's loader cuts every tensor along the sequence and copies other values to each shard
    assert batch[NUM_TOKENS_KEY] == 8 and type(batch[NUM_TOKENS_KEY]) is int


def test_a_ulysses_plan_reaches_the_trainer_and_the_deepspeed_batch_counts_every_rank(tmp_path, monkeypatch):
    from finetune import rundir
    from finetune.train.base_trainer import common_kwargs

    cfg, plan = planned(*ULYSSES, "train.batch_size=4")
    run = tmp_path / "run"
    run.mkdir()
    rundir.save_config(cfg, run)
    files = write_engine_files(cfg, plan, run)
    s = plan.strategy
    assert s.micro_batch_size * s.grad_accum_steps == 4  # one data-parallel rank: the two share each sequence
    # zero.Init and the Trainer check micro x accumulation x world; accelerate rewrites it for the data-parallel
    # ranks before deepspeed.initialize
    assert json.loads(files.deepspeed.read_text())["train_batch_size"] == 4 * 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    # SFTConfig's arguments (building SFTConfig itself would start accelerate's two-rank state)
    pc = common_kwargs(cfg, plan, run, torch.float32)["parallelism_config"]
    assert (pc.sp_size, pc.sp_backend, pc.sp_handler.sp_attn_implementation) == (2, "deepspeed", "sdpa")


def test_a_rank_refuses_to_train_a_ring_split_in_one_line(tmp_path, monkeypatch):
    """The ring has no CPU kernel (tests/test_sequence_parallel.py): planned and launched, not trained."""
    from finetune import rundir
    from finetune.core.errors import LaunchError
    from finetune.train.sft_trainer import build_config

    cfg, plan = planned(
        "+recipe=llama8b_lora_128k", "train.sequence_split=ring", "train.sequence_parallel=4",
        "train.sharding=fsdp", "data.packing=false",
    )  # fmt: skip
    run = tmp_path / "run"
    run.mkdir()
    rundir.save_config(cfg, run)
    write_engine_files(cfg, plan, run)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(LaunchError) as err:
        build_config(cfg, plan, run, torch.bfloat16)
    words = str(err.value)
    assert "strategy.sequence_split=ring" in words and "training with it is not built" in words
    assert "train.sequence_split=ulysses" in words and "\n" not in words


# ---------------------------------------------------------------- two CPU ranks through the pipeline

STEPS = 3
# Measured on 2 CPU cores, ZeRO-3 on two ranks with and without the split, the same 4 sequences
# a step, 3 steps, the largest relative difference of a step's loss / gradient norm: fp32 9e-8 / 1.2e-7
# (TRL's loss: 4.5e-7 / 1.2e-6); bf16 7.0e-4 / 7.9e-4 (DeepSpeed's bf16 weights, the all-to-alls' order).
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3}


def _run(root: Path, name: str, dtype: str, split: bool, chunked: bool = True) -> dict:
    run_dir = root / name
    shape = (
        ["train.sequence_parallel=2", "train.sequence_split=ulysses", "train.micro_batch_size=1",
         "train.grad_accum_steps=4"]
        if split
        else ["train.sequence_parallel=1", "train.micro_batch_size=1", "train.grad_accum_steps=2"]
    )  # fmt: skip
    args = [
        f"run_dir={run_dir}", f"data.cache_dir={root / 'data-cache'}", "hardware=cpu", "hardware.gpus_per_node=2",
        "train.sharding=zero3", "train.engine=zero3", "data.packing=false", SEQ_LEN, "train.batch_size=4",
        *shape, f"train.max_steps={STEPS}", f"train.save_steps={STEPS}", "train.eval_steps=1000",
        "train.logging_steps=1", "train.warmup_ratio=0.0", "method.lora_dropout=0.0", "train.report_to=[]",
        f"method.precision={dtype}", f"train.chunked_loss={str(chunked).lower()}",
    ]  # fmt: skip
    run_modes(args, root / name, timeout=1200)
    history = json.loads((run_dir / "checkpoints" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return {
        "losses": losses(run_dir / "checkpoints" / f"checkpoint-{STEPS}"),
        "grad_norms": [e["grad_norm"] for e in history["log_history"] if "grad_norm" in e],
        "engine": json.loads((run_dir / "metrics.json").read_text())["train"]["engine"],
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_cache) -> Path:
    return tmp_path_factory.mktemp("sequence-split")


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ulysses_trains_on_two_cpu_ranks_like_the_same_run_without_the_split(root, dtype):
    split, whole = _run(root, f"split-{dtype}", dtype, True), _run(root, f"whole-{dtype}", dtype, False)
    tol = TOLERANCE[dtype]
    assert len(split["losses"]) == len(whole["losses"]) == STEPS
    for a, b in zip(split["losses"], whole["losses"]):
        assert a == pytest.approx(b, rel=tol), (split["losses"], whole["losses"])
    # the gradient too, not only the loss (AdamW's step barely depends on the gradient's scale)
    assert split["grad_norms"][0] == pytest.approx(whole["grad_norms"][0], rel=tol)
    engine = split["engine"]
    assert engine["world_size"] == 2 and engine["zero_stage"] == 3 and engine["loss"] == "chunked"
    record = engine["sequence_split"]
    assert (record["sp_size"], record["backend"], record["attention"]) == (2, "deepspeed", "sdpa")
    shares = [r["sequence_share"] for r in engine["ranks"]]
    # each rank ran its forwards on half of every (padded) sequence: equal token counts, half-width shards
    assert shares[0] == shares[1] and shares[0]["tokens"] > 0
    assert all(w <= 64 for w in shares[0]["shard_widths"])
    assert "sequence_share" not in whole["engine"]["ranks"][0]
