"""gpt-oss's decoder layer as the activation formulas count it, to the byte: eager attention (its sinks have no
SDPA path in transformers) with its softmax over T + 1 columns, the router's softmax over its top-k logits, the
clamped SwiGLU and the trained expert biases; and what the plan holds for that attention path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import planned, script_module

from finetune.planner.activations import LayerRun, LayerShape, eager_scores_bytes, layer_bytes_per_token

ROOT = Path(__file__).resolve().parent.parent
MEASUREMENTS = json.loads((ROOT / "finetune" / "planner" / "activations.json").read_text())["measurements"]
SCRIPT = script_module("measure_activations")
TINY = ("model.architecture=gpt_oss", "model.num_experts=4", "model.num_experts_per_token=2",
        "model.intermediate_size=48", "model.attention_bias=true")  # fmt: skip


def test_stored_gpt_oss_rows_cover_every_case_and_match_to_the_byte():
    rows = [r for r in MEASUREMENTS if r.get("family") == "gpt_oss"]
    assert {(r["shape"], r["case"], r["tokens"]) for r in rows} == {
        (shape, case, tokens)
        for shape, (family, *_) in SCRIPT.MOE_SHAPES.items()
        if family == "gpt_oss"
        for case in SCRIPT.MOE_CASES
        for tokens in (64, 128)
    }
    assert len(rows) == 3 * 7 * 2
    for row in rows:
        assert SCRIPT.moe_formula_bytes(row) == row["bytes"], (row["shape"], row["case"], row["tokens"])


@pytest.mark.parametrize("case", ["moe_lora_bf16", "moe_lora_fp32_autocast_experts", "moe_full_autocast"])
def test_live_measurement_of_a_tiny_gpt_oss_layer(case: str):
    family, shape, experts, k, norm = SCRIPT.MOE_SHAPES["gpt_oss_0"]
    layer = SCRIPT.moe_case_layer(SCRIPT.moe_layer(family, shape, experts, k, norm), family, case)
    row = dict(
        dims=list(shape), family=family, experts=experts, experts_per_token=k, norm_topk_prob=norm, case=case
    )
    for tokens in (64, 96):
        measured = SCRIPT.measure_layer(shape, case, tokens, layer, family=family)
        assert SCRIPT.moe_formula_bytes({**row, "tokens": tokens}) == measured


def test_what_gpt_oss_keeps_beyond_the_qwen3_moe_formula():
    """Per token at hidden 64, expert width 48, 4 heads of 16 (2 kv), 4 experts with 2 routed, LoRA on attention
    in bf16: 708 bytes more than the SDPA sparse layer of Qwen3-MoE's formula, every one named."""
    h, i, heads, kv_heads, d, experts, k, c = 64, 48, 4, 2, 16, 4, 2, 2
    qwen = LayerShape(hidden=h, intermediate=i, heads=heads, kv_heads=kv_heads, head_dim=d, experts=experts,
                      experts_per_token=k)  # fmt: skip
    gpt_oss = LayerShape(
        hidden=h, intermediate=i, heads=heads, kv_heads=kv_heads, head_dim=d, experts=experts,
        experts_per_token=k, fp32_norm_product=True, softmax_after_topk=True, clamped_swiglu=True,
        expert_biases=True,
    )  # fmt: skip
    lora = LayerRun(method="lora", adapter_bytes=2)
    # eager attention: k and v repeated for every head (2c(q - kv)), the max's int64 indices where SDPA keeps
    # an fp32 logsumexp (4H more)
    eager = 2 * c * (heads * d - kv_heads * d) + 4 * heads
    # the clamped SwiGLU: clamped gate and up, sigmoid(1.702 gate) and up + 1 where SiLU keeps act(gate) (3I a copy)
    swiglu = k * c * 3 * i
    # the router: a softmax over the k logits (k values) instead of one over every expert in fp32 (4E)
    router = k * c - 4 * experts
    assert (eager, swiglu, router) == (144, 576, -12)
    with_eager = LayerRun(method="lora", adapter_bytes=2, attention="eager")
    assert layer_bytes_per_token(gpt_oss, with_eager) - layer_bytes_per_token(qwen, lora) == 708
    assert layer_bytes_per_token(gpt_oss, with_eager) == 2800
    # full fine-tuning also keeps the norms' fp32 product (2h a norm) and the biases' sorted expert ids (8k)
    full = LayerRun(method="full", attention="eager")
    gap = layer_bytes_per_token(gpt_oss, full) - layer_bytes_per_token(qwen, LayerRun(method="full"))
    assert gap == eager + swiglu + router + 2 * 2 * h + 8 * k


def test_eager_scores_are_fp32_with_fp32_weights_and_copied_for_the_values():
    bf16 = eager_scores_bytes(heads=4, tokens=128, rows=2, run=LayerRun(method="lora", adapter_bytes=2))
    assert bf16 == 2 * 4 * 128 * 129 * 2
    autocast_full = eager_scores_bytes(
        heads=4, tokens=128, rows=2, run=LayerRun(method="full", autocast=True)
    )
    assert autocast_full == 2 * 4 * 128 * 129 * 4 + 2 * 4 * 128 * 128 * 2
    fp32 = eager_scores_bytes(heads=4, tokens=128, rows=2, run=LayerRun(method="lora", dtype_bytes=4))
    assert fp32 == 2 * 4 * 128 * 129 * 4


def test_cpu_plan_holds_every_layer_s_scores_without_checkpointing_and_the_masks_with_it():
    cfg, plan = planned(*TINY, "train.seq_len=128", "train.activation_checkpointing=false")
    s, m = plan.strategy, cfg.model
    c = 4 if cfg.method.precision in ("fp32", "auto") else 2
    assert (s.attention, m.num_layers, m.num_heads) == ("eager", 4, 4)
    # each layer's softmax output over T + 1 columns (the sink), per row of 128 tokens; no SDPA [T, T] bias
    assert plan.gpu_memory.attention * 1e9 == pytest.approx(4 * s.micro_batch_size * 4 * 128 * 129 * c)
    cfg, plan = planned(*TINY, "train.seq_len=128", "train.activation_checkpointing=true")
    rows = plan.strategy.micro_batch_size
    # the layer being recomputed, and the model's float masks (full and sliding) the checkpoint keeps
    scores, masks = rows * 4 * 128 * 129 * c, 2 * rows * 128 * 128 * c
    assert plan.gpu_memory.attention * 1e9 == pytest.approx(scores + masks)


def test_the_checkpoint_keeps_the_model_s_two_float_masks():
    """What `attention.path_bytes` counts under checkpointing: transformers makes a float [T, T] mask per layer
    type (full and sliding) for eager attention; the checkpointed layers keep them until the backward, and
    without checkpointing they are gone when the forward returns."""
    import gc
    import weakref

    import torch
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss

    made: list = []

    def recorded(make):
        def wrapper(*args, **kwargs):
            mask = make(*args, **kwargs)
            made.append((mask.dtype, tuple(mask.shape), weakref.ref(mask)))
            return mask

        return wrapper

    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = modeling_gpt_oss.GptOssForCausalLM(config).to(torch.bfloat16).train()
    ids = torch.randint(0, 256, (1, 64))
    alive = {}
    for checkpointing in (True, False):
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
        made.clear()
        with pytest.MonkeyPatch.context() as patch:
            for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
                patch.setattr(modeling_gpt_oss, name, recorded(getattr(modeling_gpt_oss, name)))
            out = model(input_ids=ids, labels=ids, use_cache=False)
        gc.collect()
        assert [(dtype, shape) for dtype, shape, _ in made] == [(torch.bfloat16, (1, 1, 64, 64))] * 2
        alive[checkpointing] = [ref() is not None for *_, ref in made]
        del out
    assert alive == {True: [True, True], False: [False, False]}
