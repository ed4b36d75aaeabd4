"""The throughput levers (finetune/train/throughput.py): each switch is exact against the default path.

Packed rows equal separate sequences under every attention implementation the CPU runs (forward and
gradients); the fused optimizer, bf16 adapters and compiled decoder layers train like the default
path through the real trainer; Liger and flash-attn, which need CUDA, are wired and refused in one
line where they cannot run. What they gain is measured on a GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import last_losses, plan_for, run_cli, tiny_cfg, train_run, write_engine

from finetune.core.errors import ConfigError
from finetune.modeling.collator import IGNORE_INDEX, NUM_TOKENS_KEY, PackedCollator
from finetune.pipeline.cli import compose
from finetune.train import throughput

STEPS = 4
# LoRA without dropout at a learning rate that moves in STEPS steps, no warmup, one checkpoint at the end.
LORA_RUN = (
    "method=lora",
    "method.lora_dropout=0.0",
    "method.learning_rate=5e-3",
    f"train.max_steps={STEPS}",
    "train.save_steps=1000",
    "train.warmup_ratio=0.0",
)


def _train(tmp_path: Path, tiny_data, name: str, *overrides: str) -> dict:
    cfg = tiny_cfg(*LORA_RUN, *overrides, run_dir=tmp_path / name)
    return train_run(
        cfg, tiny_data, n_train=32, n_eval=8, max_generate=2, micro_batch_size=2, grad_accum_steps=2
    )


def _losses(metrics: dict) -> list[float]:
    return last_losses(Path(metrics["train"]["output_dir"]).parent)


def _adapter(metrics: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(metrics["train"]["output_dir"]) / "adapter_model.safetensors"))


# ---------------------------------------------------------------- the switches and their refusals


def test_defaults_are_the_baseline_and_bad_values_name_the_key():
    t = compose([]).train
    # attention unset: the planner's (SDPA; FlexAttention for long packed rows on one GPU)
    assert (t.attention, t.liger, t.compile, t.fused_optimizer, t.profile) == (
        None,
        False,
        False,
        None,
        False,
    )
    with pytest.raises(
        ConfigError, match=r"train.attention='xformers' is not one of sdpa, flex, eager, flash"
    ):
        compose(["train.attention=xformers"])
    for key, why in (
        ("train.attention=flex", "FlexAttention has no backward on the CPU"),
        ("train.attention=flash", "flash-attn's kernels are CUDA kernels"),
        ("train.liger=true", "Liger's kernels are Triton GPU kernels"),
    ):
        with pytest.raises(ConfigError, match=f"needs CUDA \\({why}\\)"):
            compose(["hardware=cpu", key])
        compose(["hardware=h200", key])  # a GPU profile: accepted
    with pytest.raises(
        ConfigError, match="train.compile=true is proven with train.sharding=none or ddp only"
    ):
        compose(["hardware=h200", "train.compile=true", "train.sharding=fsdp"])


def test_a_lever_this_machine_cannot_run_is_refused_in_one_line(monkeypatch):
    cuda, installed = {"ok": False}, set()
    monkeypatch.setattr(throughput, "_cuda", lambda: cuda["ok"])
    monkeypatch.setattr(throughput, "_installed", lambda module: module in installed)

    def refusal(*overrides: str, sharding: str = "none") -> str:
        with pytest.raises(ConfigError) as err:
            throughput.check_runtime(compose(["hardware=h200", *overrides]), sharding)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "needs the liger-kernel package (pip install 'finetune[liger]')" in refusal("train.liger=true")
    assert "needs the flash-attn package" in refusal("train.attention=flash")
    installed.update({"liger_kernel", "flash_attn"})
    assert (
        refusal("train.liger=true")
        == "train.liger=true needs a CUDA GPU (Liger's kernels are Triton GPU kernels); none here"
    )
    assert refusal("train.attention=flash") == "train.attention=flash needs a CUDA GPU; none here"
    assert "FlexAttention has no backward on the CPU" in refusal("train.attention=flex")
    cuda["ok"] = True
    for ok in ("train.liger=true", "train.attention=flash", "train.attention=flex", "train.compile=true"):
        throughput.check_runtime(compose(["hardware=h200", ok]), "none")
    # The planner may choose the sharding: compile is refused at the worker when it chose FSDP or ZeRO-3.
    assert "the plan shards with zero3" in refusal("train.compile=true", sharding="zero3")


def test_liger_refused_on_the_command_line(tmp_path):
    proc = run_cli("mode=plan", "hardware=cpu", "train.liger=true", f"run_dir={tmp_path}", timeout=300)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "train.liger=true needs CUDA (Liger's kernels are Triton GPU kernels); leave it off on hardware=cpu"
        )
    )


def test_liger_goes_through_trls_switch_and_reaches_the_trainer(tmp_path, tiny_cache, tiny_data, monkeypatch):
    """liger-kernel is not installed here: the switch's SFTConfig arguments reach transformers'
    `apply_liger_kernel` when training starts (recorded instead of run), TRL's LM head stays, and the
    chunked loss is told to use Liger's kernel (which it does for CUDA tensors only)."""
    import transformers.trainer

    from finetune.modeling.loading import load_for_training
    from finetune.modeling.models import load_tokenizer
    from finetune.train.base_trainer import build_trainer
    from finetune.train.sft_trainer import build_config

    assert throughput.sft_kwargs(compose(["hardware=h200"])) == {}
    kwargs = throughput.sft_kwargs(compose(["hardware=h200", "train.liger=true"]))
    assert kwargs == {
        "use_liger_kernel": True,
        "liger_kernel_config": {
            "rope": True,
            "rms_norm": True,
            "swiglu": True,
            "cross_entropy": False,
            "fused_linear_cross_entropy": False,
        },
    }
    applied = []
    monkeypatch.setattr(
        transformers.trainer, "apply_liger_kernel", lambda model, config: applied.append(config)
    )
    cfg = tiny_cfg(*LORA_RUN, "train.max_steps=1", run_dir=tmp_path / "run")
    plan = plan_for(cfg, micro_batch_size=2, grad_accum_steps=1, chunked_loss=True)
    write_engine(cfg, plan, tmp_path / "run")
    args = build_config(cfg, plan, tmp_path / "run", torch.float32)
    args.use_liger_kernel, args.liger_kernel_config = True, dict(kwargs["liger_kernel_config"])  # as on a GPU
    model, dtype = load_for_training(cfg)
    train, evals = tiny_data
    trainer = build_trainer(
        cfg, plan, tmp_path / "run", model, load_tokenizer(cfg.model), train.select(range(8)),
        evals.select(range(4)), dtype, callbacks=[], args=args,
    )  # fmt: skip
    trainer.train()
    assert applied == [kwargs["liger_kernel_config"]]
    assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[0]["loss"])
    assert throughput.record(trainer)["liger"] is True


# ---------------------------------------------------------------- attention: packed rows == separate sequences


def _segments(position_ids: list[int]) -> list[tuple[int, int]]:
    starts = [i for i, p in enumerate(position_ids) if p == 0] + [len(position_ids)]
    return list(zip(starts[:-1], starts[1:]))


def _lora_model(tiny_cache, attention: str, precision: str):
    from finetune.modeling.chunked_loss import add_chunked_loss_head
    from finetune.modeling.loading import load_for_training

    # flex: a GPU profile gets past the config's refusal; the model still loads on the CPU (LoRA has no
    # device map), in fp32 (on "cuda" without CUDA, bf16 would fall back to fp32).
    assert attention != "flex" or precision == "fp32"
    cfg = compose(
        [
            "hardware=h200" if attention == "flex" else "hardware=cpu",
            "method=lora",
            "method.lora_dropout=0.0",
            f"method.precision={precision}",
            f"train.attention={attention}",
        ]
    )
    torch.manual_seed(0)
    model, _ = load_for_training(cfg)
    with torch.no_grad():  # non-zero B, so every adapter has a gradient
        generator = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    add_chunked_loss_head(model)
    return model.train()


def _loss_and_grads(model, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The summed token loss (num_items_in_batch=1) and the adapters' gradients."""
    model.zero_grad(set_to_none=True)
    batch = {k: v for k, v in batch.items() if k != NUM_TOKENS_KEY}
    loss = model(**batch, chunked_loss=True, num_items_in_batch=1, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads


def _packed_vs_separate(model, rows: list[dict]) -> tuple[float, dict, float, dict]:
    """(loss, gradients) of the rows packed as they are, and summed over each sample run alone."""
    collate = PackedCollator(pad_token_id=0)
    packed_loss, packed_grads = _loss_and_grads(model, collate(rows))
    separate_loss, separate_grads = 0.0, None
    for row in rows:
        for start, end in _segments(list(row["position_ids"])):
            sample = {k: list(row[k][start:end]) for k in ("input_ids", "labels", "position_ids")}
            loss, grads = _loss_and_grads(model, collate([sample]))
            separate_loss += loss
            separate_grads = (
                grads if separate_grads is None else {n: separate_grads[n] + g for n, g in grads.items()}
            )
    return packed_loss, packed_grads, separate_loss, separate_grads


def _several_samples_a_row(tiny_data, n: int = 2) -> list[dict]:
    rows = [tiny_data[0][i] for i in range(n)]
    assert all(len(_segments(list(r["position_ids"]))) >= 3 for r in rows)  # really packed
    return rows


# Largest difference over the largest value of each gradient (sums of many terms: elementwise relative
# errors of near-zero entries say nothing). fp32: rounding; bf16: the packed and separate matmuls differ
# in shape, so they round differently (2^-8 a value).
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}


def _assert_grads_close(actual: dict, expected: dict, rel: float) -> None:
    """Per tensor (gradients, or adapters): the largest difference within `rel` of the largest value."""
    assert set(actual) == set(expected) and len(expected) == 2 * 7 * 4  # A and B of 7 projections x 4 layers
    for name, g in expected.items():
        scale = float(g.abs().max())
        assert scale > 0, name
        assert float((actual[name] - g).abs().max()) <= rel * scale, name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_equal_separate_sequences(tiny_cache, tiny_data, attention, precision):
    model = _lora_model(tiny_cache, attention, precision)
    assert model.get_base_model().config._attn_implementation == attention
    packed_loss, packed, separate_loss, separate = _packed_vs_separate(
        model, _several_samples_a_row(tiny_data)
    )
    rel = TOLERANCE[precision]
    assert packed_loss == pytest.approx(separate_loss, rel=rel)
    _assert_grads_close(packed, separate, rel)


def _flex_math_reference(monkeypatch) -> None:
    """FlexAttention's own math implementation (the higher-order op run eagerly, forward and backward),
    with the CPU's refusal of a backward lifted: the block mask transformers builds for packed rows is
    what is proven here; the CUDA kernel's numerics are the GPU check's."""
    import torch.nn.attention.flex_attention as flex
    import transformers.integrations.flex_attention as hf_flex

    monkeypatch.setattr(flex, "_validate_device", lambda query, key, value: None)
    monkeypatch.setattr(
        hf_flex,
        "compile_friendly_flex_attention",
        lambda query, key, value, training=False, **kwargs: flex.flex_attention(query, key, value, **kwargs),
    )


@pytest.mark.slow
def test_flex_block_mask_keeps_packed_samples_apart(tiny_cache, tiny_data, monkeypatch):
    import warnings

    _flex_math_reference(monkeypatch)
    rows = _several_samples_a_row(tiny_data)
    with warnings.catch_warnings():
        # Dynamo traces torch's own code here and turns its warnings into errors under pytest's
        # `error` filter: "flex_attention called without torch.compile" (meant: the math reference),
        # create_block_mask's deprecated `_compile` (passed by transformers), vmap's and
        # autograd's internal deprecations. None is ours; they are silenced for this test alone.
        warnings.simplefilter("ignore")
        model = _lora_model(tiny_cache, "flex", "fp32")
        assert model.get_base_model().config._attn_implementation == "flex_attention"
        packed_loss, packed, separate_loss, separate = _packed_vs_separate(model, rows)
        sdpa_loss, sdpa, _, _ = _packed_vs_separate(_lora_model(tiny_cache, "sdpa", "fp32"), rows)
    assert packed_loss == pytest.approx(separate_loss, rel=1e-5) and packed_loss == pytest.approx(
        sdpa_loss, rel=1e-5
    )
    _assert_grads_close(packed, separate, 1e-5)
    _assert_grads_close(packed, sdpa, 1e-5)


def test_flattened_micro_batch_is_one_row_and_trains_the_same(tiny_cache, tiny_data):
    """`flatten=True` (train.attention=flash: flash-attn's variable-length path needs one row): the
    micro-batch becomes one unpadded row, with the same loss and gradients as the padded batch."""
    rows = [tiny_data[0][i] for i in (0, 300, 533)]  # different lengths: the batch has padding
    lengths = [len(r["input_ids"]) for r in rows]
    assert len(set(lengths)) > 1
    flat = PackedCollator(pad_token_id=0, flatten=True)(rows)
    batch = PackedCollator(pad_token_id=0)(rows)
    assert flat["input_ids"].shape == (1, sum(lengths)) and int(flat[NUM_TOKENS_KEY]) == sum(lengths)
    assert flat["input_ids"][0].tolist() == [t for r in rows for t in r["input_ids"]]
    assert flat["position_ids"][0].tolist() == [p for r in rows for p in r["position_ids"]]
    assert int((flat["labels"] != IGNORE_INDEX).sum()) == int((batch["labels"] != IGNORE_INDEX).sum())
    for attention in ("sdpa", "eager"):
        model = _lora_model(tiny_cache, attention, "fp32")
        flat_loss, flat_grads = _loss_and_grads(model, flat)
        loss, grads = _loss_and_grads(model, batch)
        assert flat_loss == pytest.approx(loss, rel=1e-5)
        _assert_grads_close(flat_grads, grads, 1e-5)


# ---------------------------------------------------------------- through the real trainer


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_cache, tiny_data) -> dict:
    """The default path, fp32 (the CPU's precision), with the step profiler on."""
    return _train(tmp_path_factory.mktemp("baseline"), tiny_data, "run", "train.profile=true")


def test_profile_splits_each_step_of_the_real_run(baseline):
    p, t = baseline["train"]["profile"], baseline["train"]
    steps = p["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)) and p["profiled_step"] == STEPS
    assert p["timed_steps"] == list(range(2, STEPS)) and p["synchronized"] is False
    for s in steps:
        phases = sum(s[k] for k in ("data", "forward", "loss", "backward", "optimizer", "other"))
        assert phases == pytest.approx(s["step_s"], abs=1e-5)
        assert (
            s["forward"] > 0 and s["loss"] > 0 and s["backward"] > 0 and s["optimizer"] > 0 and s["data"] > 0
        )
    # Every real token of each step's micro-batches (2 x 2 rows of up to 128), and in total the monitor's count.
    assert all(0 < s["tokens"] <= 4 * 128 for s in steps) and sum(s["tokens"] for s in steps) == t["tokens"]
    timed = [s for s in steps if s["step"] in p["timed_steps"]]
    rates = sorted(s["tokens"] / s["step_s"] for s in timed)
    assert p["tokens_per_second"] == pytest.approx((rates[0] + rates[-1]) / 2, rel=1e-3)  # the median of 2
    assert sum(p["share"].values()) == pytest.approx(1.0, abs=0.2)  # medians of each phase, not one step
    assert p["top_ops"] and any(op["name"].startswith("aten::") for op in p["top_ops"])
    table = (Path(t["output_dir"]).parent / "profile_ops.txt").read_text()
    assert "Self CPU" in table and p["top_ops"][0]["name"] in table


def test_eager_attention_trains_like_sdpa(tmp_path, tiny_data, baseline):
    eager = _train(tmp_path, tiny_data, "eager", "train.attention=eager")
    assert (
        eager["train"]["engine"]["attention"] == "eager"
        and baseline["train"]["engine"]["attention"] == "sdpa"
    )
    assert _losses(eager) == pytest.approx(_losses(baseline), rel=1e-4)


def test_fused_optimizer_trains_like_the_unfused_one(tmp_path, tiny_data, baseline):
    """torch (ARCHITECTURE.md, "Checked against") runs the fused AdamW on the CPU too: the same trajectory to
    fp32 rounding."""
    fused = _train(tmp_path, tiny_data, "fused", "train.fused_optimizer=true")
    assert fused["train"]["engine"]["fused_optimizer"] is True
    assert baseline["train"]["engine"]["fused_optimizer"] is False
    assert fused["train"]["engine"]["optimizer_kind"] == "adamw"
    assert _losses(fused) == pytest.approx(_losses(baseline), rel=1e-5)
    # The trained adapters: within 2e-4 of their largest weight (about 4% of one step's update at lr 5e-3;
    # Adam's normalised step carries the kernels' last-bit differences into the weights, and how many bits
    # differ depends on the processor's vector width: 1.4e-4 was seen on an AVX-512 machine).
    _assert_grads_close(_adapter(fused), _adapter(baseline), 2e-4)


def test_bf16_adapters_train_like_fp32_adapters_within_bf16_rounding(tmp_path, tiny_data):
    """Under bf16 autocast the adapters' matmuls run in bf16 either way; bf16 storage rounds the weights,
    their gradients and the optimizer's moments to bf16 (8 bits of mantissa: 2^-8 = 0.4% a value).
    Stated tolerance: each step's loss within 2.5% of the fp32-adapter run's over the first steps (the
    fourth is a loss spike), the held-out loss after them within 5%."""
    fp32 = _train(tmp_path, tiny_data, "fp32", "method.precision=bf16", "method.adapter_dtype=fp32")
    bf16 = _train(tmp_path, tiny_data, "bf16", "method.precision=bf16", "method.adapter_dtype=bf16")
    assert fp32["train"]["engine"]["parameter_dtypes"] == ["bfloat16", "float32"]
    assert bf16["train"]["engine"]["parameter_dtypes"] == ["bfloat16"]
    la, lb = _losses(fp32), _losses(bf16)
    assert la[0] == pytest.approx(lb[0], rel=1e-3)  # B = 0 at the start: the same forward
    # 2.5e-2: the fourth step's batch is a loss spike (1.9 -> 6.6), where bf16's rounding of the weights
    # and moments shows most; the other steps agree within 1e-3
    assert lb == pytest.approx(la, rel=2.5e-2), (la, lb)
    for run in (fp32, bf16):  # both learn: the held-out loss falls
        assert run["eval"]["trained"]["loss"] < run["eval"]["base"]["loss"] - 0.3
    # after the spike, 4 steps leave the held-out loss 4-5 nats up, where the runs' small differences read 4%
    assert bf16["eval"]["trained"]["loss"] == pytest.approx(fp32["eval"]["trained"]["loss"], rel=5e-2)


def test_bf16_adapter_gradients_match_fp32_adapters_within_bf16_rounding(tiny_cache, tiny_data):
    """The same adapter values (bf16-representable), one packed batch under bf16 autocast: gradients
    agree to bf16 rounding (largest difference within 2% of the largest gradient)."""
    batch = PackedCollator(pad_token_id=0)(_several_samples_a_row(tiny_data))
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _lora_model(tiny_cache, "sdpa", "bf16")
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16).to(dtype)  # the same values, stored in `dtype`
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, grads[dtype] = _loss_and_grads(model, batch)
        assert math.isfinite(loss)
    _assert_grads_close(grads[torch.bfloat16], grads[torch.float32], 2e-2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [[], ["method.precision=bf16"], ["train.activation_checkpointing=true"], ["method=qlora"]],
    ids=["fp32", "bf16", "checkpointing", "qlora"],
)
def test_compiled_decoder_layers_train_like_eager_ones(tmp_path, tiny_data, overrides):
    """torch.compile of each decoder layer (inductor's CPU backend): the same trajectory (fp32 to 1e-4;
    bf16 to 1e-2: inductor keeps a fused kernel's intermediates in fp32, eager rounds each op to bf16)."""
    import warnings

    eager = _train(tmp_path, tiny_data, "eager", *overrides)
    with warnings.catch_warnings():
        # Dynamo reads `.grad` of the layer's (non-leaf) input while it traces, and instantiates
        # bitsandbytes' autograd Function; pytest's `error` filter would turn torch's warnings about
        # those into a failed compile. Not ours.
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        warnings.filterwarnings("ignore", message=".*autograd.function.Function'> should not be instantiated")
        compiled = _train(tmp_path, tiny_data, "compiled", "train.compile=true", *overrides)
    assert compiled["train"]["engine"]["compiled_layers"] is True
    assert eager["train"]["engine"]["compiled_layers"] is False
    # bf16 (QLoRA: adapters): 3e-2, since the fourth step's batch is a loss spike (1.9 -> 6.6) whose
    # confidently wrong logits amplify the two paths' roundings, and the held-out loss carries it
    rel = 1e-4 if overrides in ([], ["train.activation_checkpointing=true"]) else 3e-2
    assert _losses(compiled) == pytest.approx(_losses(eager), rel=rel)
    # Evaluation and generation ran the layers uncompiled, after training, on the trained adapters.
    assert compiled["eval"]["trained"]["loss"] == pytest.approx(eager["eval"]["trained"]["loss"], rel=rel)
