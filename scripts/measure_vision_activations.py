"""Measure what a vision-language model's encoder keeps for backward in a real training step, and the step's peak.

One micro-batch of the tiny VLM (finetune/modeling/tiny_vlm.py, Idefics3: SigLIP encoder, pixel-shuffle
projector, Llama decoder) through the project's own trainer (finetune/train/base_trainer.py, TRL's
SFTTrainer with the vision collator), one picture a row and each row exactly `train.seq_len` tokens:

- the encoder's saved bytes: every tensor autograd saves while the vision model and the projector run
  (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded, counted while still held at the end of
  the forward (the first encoder layer's norm keeps nothing when its input needs no gradient);
- the step: the bytes held before it (weights, trainable gradients, Adam's moments) plus the peak of what its
  forward and backward allocate (scripts/bench_planner.py's `LiveBytes`);

each against the planner's figure for the same job (`vision_activations`, `tensors_gb`). Activation
checkpointing is turned on as `Trainer.train` does (`activation_checkpointing_enable`, non-reentrant); the
forward runs under accelerate's autocast as the trainer's does.

Usage:
    python scripts/measure_vision_activations.py                       # the cases below, a table
    python scripts/measure_vision_activations.py method.precision=bf16  # extra overrides for every case
"""

from __future__ import annotations

import io
import json
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# A tiny VLM whose encoder is a good share of the step: 128 px pictures in 8 px patches (256 patches, 64 image
# tokens after the 2 x 2 merge), a 4-layer encoder of width 128.
SHAPE = (
    "+recipe=tiny_vlm",
    "model.image_size=128",
    "model.vision_hidden_size=128",
    "model.vision_intermediate_size=512",
    "model.vision_layers=4",
    "train.seq_len=96",
)
# case name: (overrides, activation checkpointing)
CASES: dict[str, tuple[tuple[str, ...], bool]] = {
    "frozen": (("method.lora_vision=false",), False),
    "frozen_ckpt": (("method.lora_vision=false",), True),
    "lora_vision": (("method.lora_vision=true",), False),
    "lora_vision_ckpt": (("method.lora_vision=true",), True),
    "lora_vision_bf16": (("method.lora_vision=true", "method.precision=bf16"), False),
    "full": (("method=full",), False),
}


def _script(name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def picture(side: int, seed: int) -> bytes:
    """A PNG of random colours (never all zero: Idefics3 drops all-zero pictures as padding)."""
    from PIL import Image

    rng = random.Random(seed)
    pixels = bytes(rng.randrange(1, 256) for _ in range(side * side * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), pixels).save(out, format="PNG")
    return out.getvalue()


def rows(processor: Any, count: int, side: int, tokens: int) -> list[dict[str, Any]]:
    """`count` image-conversation rows (the data stage's layout), each rendered to exactly `tokens` tokens."""
    from finetune.modeling.vision import rendered

    def row(i: int, answer: str) -> dict[str, Any]:
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": answer},
        ]
        return {"messages": json.dumps(messages), "images": [picture(side, i)]}

    first = row(0, "a")
    length = rendered(processor, [json.loads(first["messages"])], [first["images"]])["input_ids"].shape[1]
    return [row(i, "a" * (1 + tokens - length)) for i in range(count)]


class EncoderSaved:
    """Bytes autograd saves while the given modules run and still holds (each storage once)."""

    def __init__(self, model: Any, modules: list[Any]) -> None:
        import torch

        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.inside = False
        self.counts: dict[int, list[int]] = {}
        for module in modules:
            module.register_forward_pre_hook(lambda *_: setattr(self, "inside", True))
            module.register_forward_hook(lambda *_: setattr(self, "inside", False))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    class _Held:
        def __init__(self, owner: EncoderSaved, t: Any) -> None:
            self.t, self.owner, self.key = t, owner, t.untyped_storage().data_ptr()
            owner.counts.setdefault(self.key, [0, t.untyped_storage().nbytes()])[0] += 1

        def __del__(self) -> None:
            self.owner.counts[self.key][0] -= 1

    def _pack(self, t: Any) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if self.inside and ptr not in self.params and t.untyped_storage().nbytes():
            return EncoderSaved._Held(self, t)
        return t

    @staticmethod
    def _unpack(held: Any) -> Any:
        return held.t if isinstance(held, EncoderSaved._Held) else held

    @property
    def held(self) -> int:
        return sum(size for count, size in self.counts.values() if count > 0)


def measure(overrides: tuple[str, ...], checkpointing: bool, images: int = 8) -> dict[str, Any]:
    """The encoder's saved bytes and the step's bytes, measured and planned, for one micro-batch of `images`."""
    import torch
    from datasets import Dataset

    from finetune import rundir
    from finetune.core.composition import compose
    from finetune.modeling import loading, models
    from finetune.pipeline.stages import config_plan, resolve
    from finetune.planner import memory, tensors_gb
    from finetune.planner.job import make_job, runtime
    from finetune.planner.step import vision_activations
    from finetune.train.base_trainer import build_trainer

    bench = _script("bench_planner")
    cfg = resolve(compose(list(overrides)))
    plan = config_plan(cfg)
    s = replace(
        plan.strategy, micro_batch_size=images, grad_accum_steps=1, activation_checkpointing=checkpointing
    )
    plan = replace(plan, strategy=s)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        rundir.save_config(cfg, run_dir)
        rundir.write_json(run_dir / rundir.PLAN_FILE, plan.to_dict())
        from finetune.launch.engines import write_engine_files

        write_engine_files(cfg, plan, run_dir)
        torch.manual_seed(0)
        model, dtype = loading.load_for_training(cfg, sharded=False)
        processor = models.load_tokenizer(cfg.model)
        data = rows(processor, images, cfg.model.image_size, cfg.train.seq_len)
        trainer = build_trainer(
            cfg, plan, run_dir, model, processor, Dataset.from_list(data), None, dtype, []
        )
        model = trainer.model
        model.train()
        if checkpointing:  # what Trainer.train does before the first step
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        batch = trainer._prepare_inputs(trainer.data_collator(data))
        assert tuple(batch["input_ids"].shape) == (images, cfg.train.seq_len)
        tower = [m for n, m in model.named_modules() if n.endswith(("vision_model", "connector"))]
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, foreach=False)
        for p in trainable:  # the state of a step in progress: gradients and Adam's moments held
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=False)
        held = bench.storage_bytes(
            list(model.parameters())
            + [p.grad for p in trainable]
            + bench.optimizer_state_tensors(opt)
            + list(model.buffers())
        )
        encoder = EncoderSaved(model, tower)
        with trainer.accelerator.autocast(), encoder.hooks:
            loss = trainer.compute_loss(model, batch)
        saved = encoder.held
        del loss
        with bench.LiveBytes() as live:
            with trainer.accelerator.autocast():
                loss = trainer.compute_loss(model, batch)
            loss.backward()
            del loss
    job = make_job(
        cfg.model, cfg.method, cfg.hardware, cfg.train, cfg.train.seq_len, objective=cfg.objective.spec
    )
    # allocated bytes (what LiveBytes counts), not the resident pages of a run's peak RSS
    rt = replace(runtime(job, s), resident=False)
    mem, _ = memory(job, s, rt)
    return {
        "encoder_saved": saved,
        "encoder_planned": vision_activations(job, s, rt),
        "step": held + live.peak,
        "step_planned": tensors_gb(job, s, rt) * 1e9,
        "vision_share": mem.vision_activations * 1e9 / (held + live.peak),
    }


def measure_qwen25vl_tower(images: int = 2, side: int = 8) -> dict[str, int]:
    """Qwen2.5-VL's vision tower (transformers' own classes, random init, fp32, every weight trained: no
    torchvision, which only its processor needs) on `images` pictures of side x side patches: the bytes autograd
    saves in its forward, and the planner's for the same shape (full fine-tuning)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from finetune.planner.activations import (
        LayerRun,
        VisionShape,
        vision_layer_bytes_per_patch,
        vision_tail_bytes_per_patch,
    )

    d, f, heads, depth, patch = 64, 128, 4, 2, 14
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, bos_token_id=0, eos_token_id=1,
        ),
        vision_config=dict(
            depth=depth, hidden_size=d, intermediate_size=f, num_heads=heads, out_hidden_size=64,
            patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            fullatt_block_indexes=[1],
        ),
    )  # fmt: skip
    config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    visual = Qwen2_5_VLForConditionalGeneration(config).float().train().model.visual
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(images * side * side, 3 * 2 * patch * patch, generator=g)
    grid = torch.tensor([[1, side, side]] * images)
    saved = EncoderSaved(visual, [visual])
    with saved.hooks:
        out = visual(pixels, grid_thw=grid)
    measured = saved.held
    del out
    shape, run = VisionShape(d, f, heads, gated_mlp=True), LayerRun(method="full", dtype_bytes=4)
    per_patch = depth * vision_layer_bytes_per_patch(shape, run, adapted=False) + vision_tail_bytes_per_patch(
        shape, run, patch_pixels=3 * 2 * patch * patch, adapted=False, checkpointing=False
    )
    return {"measured": measured, "planned": images * side * side * per_patch}


def main(argv: list[str]) -> int:
    print(
        "| case | encoder saved (measured) | planned | step (measured, MB) | planned | error | encoder share |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (overrides, checkpointing) in CASES.items():
        r = measure((*SHAPE, *overrides, *argv), checkpointing)
        error = r["step_planned"] / r["step"] - 1
        print(
            f"| {name} | {r['encoder_saved']:,} | {r['encoder_planned']:,.0f} | {r['step'] / 1e6:,.1f} | "
            f"{r['step_planned'] / 1e6:,.1f} | {100 * error:+.1f}% | {100 * r['vision_share']:.0f}% |"
        )
    qwen = measure_qwen25vl_tower()
    print(
        f"\nQwen2.5-VL's tower, full fine-tuning in fp32: {qwen['measured']:,} bytes saved, {qwen['planned']:,} planned"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
