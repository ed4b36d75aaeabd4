"""Planner accuracy on CPU: the memory of a real training step, term by term, against the plan.

    python scripts/bench_planner.py                # tiny, SmolLM2-135M, one decoder layer at 8B and 70B dims (minutes)
    python scripts/bench_planner.py --only smollm2 # SmolLM2-135M-Instruct's shape alone
    python scripts/bench_planner.py --quick        # tiny model only (~2 min), used by the tests
    python scripts/bench_planner.py --only moe     # the tiny Qwen3-MoE, LoRA on attention and experts (~3 min)
    python scripts/bench_planner.py --only mixtral # the tiny Mixtral, the same
    python scripts/bench_planner.py --only dpo     # DPO: TRL's step per method, and whole runs' peak RSS vs plan
    python scripts/bench_planner.py --json out.json

Every row runs what the trainer runs (finetune/train), on the CPU in bf16 (the
dtypes a GPU run has): full fine-tuning with fp32 weights under accelerate's
bf16 autocast; LoRA r16 on all seven projections, a frozen bf16 base with fp32
PEFT adapters under autocast, dropout 0.05; QLoRA, the same on a bitsandbytes
NF4 base (double quantization, `prepare_kbit_model`) with bf16 adapters
(qlora.yaml). Rows are packed as the collator packs them (position_ids
restarting mid-row: transformers builds a block-diagonal mask for SDPA). The
loss is one of the trainer's two paths: the project's chunked loss inside the
model's forward (`add_chunked_loss_head`), or TRL's fused LM head
(`add_fused_lm_head`, SFTTrainer's outputs). For each case a model is built
from a model config (random init: configs/model/tiny.yaml and smollm2_135m.yaml
as they are; Llama-3.1-8B and -70B with one or two decoder layers and a
8,192-token vocabulary, the planner given the same shape). Zero gradients and one optimizer step on them
create the state a step in progress holds (gradients kept, as under gradient
accumulation; Adam moments); then one real forward and backward is measured,
and the optimizer steps:

- weights, trainable state: bytes of the distinct storages of the parameters
  (4-bit data and quantization constants included), gradients and optimizer
  state, held across steps;
- activations: storages autograd saves from the first decoder layer to the
  final norm (`saved_tensors_hooks`, each storage once, parameters excluded);
  with checkpointing, each layer's input (the layer being recomputed is
  transient: the planner counts it in the overhead's working set, and it shows
  in the total);
- logits (the loss's peak): live tensor bytes of the loss alone, forward and
  backward, from the final hidden states, as the trainer runs it (under
  autocast), plus the hidden states TRL's function keeps (a view of its input
  here, a copy on CUDA);
- total: the bytes held before the step plus the peak of live tensor bytes
  during its forward and backward (a TorchDispatchMode tracks every storage an
  op creates and frees).

The planned total is the four terms plus the overhead term's backward working
set above the loss peak; it leaves out the overhead's fixed share and the
allocator's, which a CPU cannot measure (scripts/gpu_check.py measures them on
a GPU). The plan is the CPU's (hardware device cpu, method.precision=bf16):
CUDA differs in dropout masks (a bool, not a noise tensor) and TRL's tile
folding (a Triton kernel in place). A last measurement times TRL's tile
folding alone at a full [4096, 32768] tile: the CPU calibration's
`trl_tile_fp32_copies`. Targets: each term within 10%, the total within 5%.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

MB = 1e6
GB = 1e9
TERMS = ("weights", "trainable_state", "activations", "logits")
TERM_TARGET, TOTAL_TARGET = 0.10, 0.05
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Case:
    shape: str  # tiny | smollm2_135m | llama3_1_8b | llama3_1_70b
    method: str  # full | lora | qlora
    checkpointing: bool
    chunked_loss: bool  # the project's chunked loss, else TRL's fused LM head
    tokens: int
    chunk_size: int
    num_layers: Optional[int] = None  # None: the model config's own
    vocab_size: Optional[int] = None
    # the shape as a mixture of experts of this family (qwen3_moe, mixtral): 4 fused experts of width 48, 2
    # routed; LoRA on attention and experts, no dropout ("": dense)
    experts: str = ""
    # sft: one packed row of `tokens`; dpo: TRL's DPO step, a chosen and a rejected row of up to `tokens` each
    objective: str = "sft"
    # bf16: the GPU's dtypes (bf16 autocast); fp32: what the CPU runs by default (method.precision=auto)
    precision: str = "bf16"

    @property
    def name(self) -> str:
        loss = "chunked" if self.chunked_loss else "trl"
        parts = [
            self.method,
            {"qwen3_moe": "moe"}.get(self.experts, self.experts),
            "ckpt" if self.checkpointing else "",
            loss,
        ]
        parts.append("dpo" if self.dpo else "")
        parts.append("fp32" if self.fp32 else "")
        return " ".join(p for p in parts if p)

    @property
    def fp32(self) -> bool:
        return self.precision == "fp32"

    @property
    def dpo(self) -> bool:
        return self.objective == "dpo"

    @property
    def dropout(self) -> float:
        """LoRA dropout: 0.05 (the method's default); none for DPO (TRL's disable_dropout, as the trainer sets)
        and for expert LoRA (PEFT's target_parameters refuses dropout)."""
        return 0.0 if self.dpo or self.experts else 0.05

    @property
    def adapter_dtype(self) -> str:
        """The method's default (configs/method): fp32 LoRA adapters, bf16 QLoRA ones."""
        return "bf16" if self.method == "qlora" else "fp32"


def model_config(case: Case) -> Any:
    """The ModelConfig of configs/model/<shape>.yaml, with the case's layers and vocabulary."""
    import yaml

    from finetune.core.composition import package_dir
    from finetune.core.config import ModelConfig

    raw = yaml.safe_load((package_dir("configs") / "model" / f"{case.shape}.yaml").read_text())
    m = ModelConfig(**raw)
    changes: dict[str, Any] = {}
    if case.num_layers is not None:
        changes["num_layers"] = case.num_layers
    if case.vocab_size is not None:
        changes["vocab_size"] = case.vocab_size
    if case.experts:  # Mixtral's experts' width is intermediate_size, and its router renormalizes
        width = {"moe_intermediate_size": 48} if case.experts == "qwen3_moe" else {"intermediate_size": 48}
        renorm = case.experts == "mixtral"
        changes.update(
            architecture=case.experts, num_experts=4, num_experts_per_token=2, norm_topk_prob=renorm, **width
        )
    return replace(m, **changes)


def cases(quick: bool) -> list[Case]:
    out = []
    for method in ("full", "lora", "qlora"):
        for ckpt in (False, True):
            for chunked in (True, False):
                out.append(Case("tiny", method, ckpt, chunked, tokens=256, chunk_size=64))
    if quick:
        return out
    # the tiny model as a Qwen3-MoE and a Mixtral (recipes/tiny_moe.yaml's, tiny_mixtral.yaml's shape), LoRA on
    # attention and experts
    for family in ("qwen3_moe", "mixtral"):
        for ckpt in (False, True):
            out.append(Case("tiny", "lora", ckpt, True, tokens=256, chunk_size=64, experts=family))
    # DPO (TRL's DPOTrainer step: the fused head on both rows, the reference forward under no_grad), one per method
    for method in ("full", "lora", "qlora"):
        out.append(Case("tiny", method, False, False, tokens=256, chunk_size=64, objective="dpo"))
    # ... and in fp32, as recipes/tiny_dpo runs on the CPU (the whole runs below): no autocast, fp32 weights
    for method in ("full", "lora"):
        dpo = dict(tokens=256, chunk_size=64, objective="dpo", precision="fp32")
        out.append(Case("tiny", method, False, False, **dpo))
    # SmolLM2-135M-Instruct whole (30 layers, its 49,152 vocabulary, tied embeddings): the real model the CPU
    # recipe fine-tunes (recipes/smollm2_135m_lora.yaml), each method once on the default loss path.
    for method in ("full", "lora", "qlora"):
        out.append(Case("smollm2_135m", method, False, True, tokens=128, chunk_size=64))
    out.append(Case("smollm2_135m", "lora", True, True, tokens=128, chunk_size=64))
    # One decoder layer (two without checkpointing) and a 8,192-token vocabulary (the planner gets the same shape), few
    # tokens: without AVX512-BF16 the bf16 backward matmuls are pathologically slow (83 s for the input gradient of one
    # 8B MLP projection at 64 tokens on the 2 shared cores here; the per-token figures do not depend on the token
    # count). Adapter methods only: full fine-tuning also needs the base's weight gradients (as slow), and 70B's one
    # layer would hold 16 GB of training state; the tiny model covers it.
    big = dict(num_layers=1, vocab_size=8192)
    # two layers without checkpointing: the first layer's input needs no gradient and it keeps ~14% less than the
    # planner's per-layer figure (exact for every later layer)
    out.append(
        Case("llama3_1_8b", "lora", False, True, tokens=16, chunk_size=8, num_layers=2, vocab_size=8192)
    )
    out.append(Case("llama3_1_8b", "lora", True, True, tokens=16, chunk_size=8, **big))
    out.append(Case("llama3_1_8b", "lora", True, False, tokens=16, chunk_size=8, **big))
    out.append(Case("llama3_1_8b", "qlora", True, True, tokens=16, chunk_size=8, **big))
    out.append(Case("llama3_1_70b", "lora", True, True, tokens=8, chunk_size=4, **big))
    return out


# ---------------------------------------------------------------- measuring


class LiveBytes:
    """TorchDispatchMode: bytes of the storages ops create and are still alive, and their peak."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                tracker._track(out, (args, kwargs))
                return out

        self._mode = _Mode()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _track(self, out: Any, inputs: Any) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        # an output sharing an input's storage (a view, an in-place or out= op) allocates nothing
        aliased = {
            t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._sizes or key in aliased:
                continue
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __enter__(self) -> LiveBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def storage_bytes(tensors: list[Any], exclude: Optional[set[int]] = None) -> int:
    """Bytes of the distinct storages of `tensors` (each once; `exclude` data pointers left out)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in (exclude or set()):
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def quant_state_tensors(model: Any) -> list[Any]:
    """The tensors of every bitsandbytes 4-bit weight's quantization state (absmax, nested absmax, code)."""
    import torch

    out = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            out += [v for v in vars(qs).values() if isinstance(v, torch.Tensor)]
            qs = getattr(qs, "state2", None)
    return out


def optimizer_state_tensors(opt: Any) -> list[Any]:
    import torch

    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


# The per-token fields TRL's fused head computes: SFTTrainer's, DPOTrainer's policy, DPOTrainer's reference copy.
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
REFERENCE_OUTPUTS = ("log_probs",)


def build_model(m: Any, case: Case, outputs: Optional[tuple[str, ...]] = None) -> Any:
    """A random-init LlamaForCausalLM of `m`'s dimensions prepared as finetune/train prepares `case.method`, its
    loss path patched in, and bf16 autocast around its forward (accelerate's mixed precision)."""
    dropout = case.dropout
    import torch
    from measure_activations import _init_, _to_qlora
    from transformers import AutoModelForCausalLM

    from finetune.modeling.chunked_loss import add_chunked_loss_head
    from finetune.modeling.tiny import hf_config

    cfg = hf_config(m)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if case.fp32 else torch.bfloat16)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device="cpu")
    if m.tie_embeddings:  # to_empty gives the head its own storage; the model shares the embedding's
        model.tie_weights()
    _init_(model)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # buffers are not initialised by to_empty
    model.train()
    if not case.chunked_loss:
        from trl.trainer.utils import add_fused_lm_head

        # as SFTTrainer / DPOTrainer, on the base model (before PEFT)
        add_fused_lm_head(model, outputs=outputs or (DPO_OUTPUTS if case.dpo else SFT_OUTPUTS))
    if case.method == "full":
        model = model.float()  # finetune/modeling/models.py: fp32 weights, bf16 autocast in the trainer
        model.requires_grad_(True)
    else:
        if case.method == "qlora":
            from finetune.modeling.loading import prepare_kbit_model

            for layer in model.model.layers:
                _to_qlora(layer)
            model = prepare_kbit_model(model, torch.bfloat16)  # PEFT's preparation, its fp32 upcast undone
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        lcfg = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0 if case.experts else dropout,
            target_modules=LORA_TARGETS[:4] if case.experts else LORA_TARGETS,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if case.experts else None,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lcfg, autocast_adapter_dtype=case.adapter_dtype == "fp32")
        if case.adapter_dtype == "bf16":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    add_chunked_loss_head(model, case.chunk_size)
    if not case.fp32:
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    return model


def _decoder_layers(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers, base.model, base.lm_head


def packed_position_ids(tokens: int) -> Any:
    """Two samples in one row, as the collator packs them: position ids restart mid-row."""
    import torch

    half = tokens // 2
    return torch.cat([torch.arange(half), torch.arange(tokens - half)])[None]


def loss_step(model: Any, ids: Any, labels: Any, case: Case, position_ids: Any = None) -> Any:
    """The trainer's forward to the loss (finetune/train/sft_trainer.py): the chunked loss inside the model's forward, or
    TRL's fused head as SFTTrainer.compute_loss calls it."""
    kwargs = dict(input_ids=ids, labels=labels, use_cache=False)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if case.chunked_loss:
        return model(**kwargs, chunked_loss=True).loss
    out = model(**kwargs, fused_lm_head=True)
    return -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)


def preference_batch(vocab: int, tokens: int) -> dict[str, Any]:
    """One pair as TRL's DataCollatorForPreference batches it: [chosen, rejected] rows sharing a prompt (the first
    quarter), the rejected answer shorter and right-padded, so the attention mask is not all ones."""
    import torch

    g = torch.Generator().manual_seed(1)
    prompt, short = tokens // 4, tokens - tokens // 8
    ids = torch.randint(1, vocab, (2, tokens), generator=g)
    ids[1, :prompt] = ids[0, :prompt]
    attention = torch.ones(2, tokens, dtype=torch.long)
    attention[1, short:] = 0
    ids[1, short:] = 0
    completion = attention.clone()
    completion[:, :prompt] = 0
    return dict(input_ids=ids, attention_mask=attention, completion_mask=completion)


def dpo_step(model: Any, reference: Any, batch: dict[str, Any], policy_hidden: Any = None) -> Any:
    """TRL's DPOTrainer._compute_loss (sigmoid loss, beta 0.1): the policy's fused-head log-probs of both rows,
    then the reference's under no_grad (a PEFT model with its adapter disabled, or the frozen copy).

    `policy_hidden`: start from the policy's final hidden states (the loss term alone), the head applied to them
    as the fused forward applies it; the reference forward still runs whole (the plan counts it in that term).
    """
    import contextlib

    import torch
    import torch.nn.functional as F

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    if policy_hidden is None:
        logps = model(**kwargs, labels=labels, fused_lm_head=True).log_probs.sum(dim=1)
    else:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        head = _decoder_layers(model)[2]
        h = policy_hidden[:, :-1].reshape(-1, policy_hidden.shape[-1])  # the CPU path scores every position
        target = labels[:, 1:]
        out = ChunkedLogProbFunction.apply(
            h, head.weight, None, target.clamp(min=0).reshape(-1), 1.0, 32768, None, 1.0, DPO_OUTPUTS
        )
        logps = out[0].view(target.shape).masked_fill(target == -100, 0).sum(dim=1)
    disabled = (
        reference.disable_adapter() if hasattr(reference, "disable_adapter") else contextlib.nullcontext()
    )
    with torch.no_grad(), disabled:
        ref = reference(**kwargs, labels=labels, fused_lm_head=True).log_probs.sum(dim=1)
    chosen, rejected = (logps - ref).chunk(2)
    return -F.logsigmoid(0.1 * (chosen - rejected)).mean()


def loss_alone(hidden: Any, head: Any, labels: Any, case: Case) -> Any:
    """The loss from the final hidden states, as each path runs it inside the autocast forward."""
    import torch

    if case.chunked_loss:
        from finetune.modeling.chunked_loss import chunked_causal_lm_loss

        return chunked_causal_lm_loss(hidden, head.weight, labels, chunk_size=case.chunk_size)
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # the CPU path: every position scored (no Triton)
    target = labels[:, 1:].clamp(min=0).reshape(-1)
    out = ChunkedLogProbFunction.apply(
        h, head.weight, None, target, 1.0, 32768, None, 1.0, ("log_probs", "entropy", "is_top1")
    )
    return -out[0].sum() / torch.tensor(target.numel())


def measure(case: Case) -> dict[str, Any]:
    """One measured training step of `case` with its state already held (bytes per term, and the total peak)."""
    import torch
    from measure_activations import SavedBytes

    m = model_config(case)
    torch.manual_seed(0)
    t0 = time.time()
    model = build_model(m, case)
    # DPO's reference: with adapters the same model, its adapter disabled; with full fine-tuning a frozen copy in
    # the policy's dtype (TRL's create_model_from_path with dtype=model.dtype), its fused head scoring log-probs only
    reference = model
    if case.dpo and case.method == "full":
        reference = build_model(m, case, outputs=REFERENCE_OUTPUTS).requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.vocab_size, (1, case.tokens), generator=g)
    labels = ids.clone()
    position_ids = packed_position_ids(case.tokens)
    batch = preference_batch(m.vocab_size, case.tokens)

    # Zero gradients and one optimizer step on them create the held state of a step in progress (gradients kept,
    # as under gradient accumulation; Adam moments) without a second, unmeasured backward: bf16 backward matmuls
    # are very slow on CPUs without AVX512-BF16.
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)

    params = list(model.parameters()) + (list(reference.parameters()) if reference is not model else [])
    frozen = [p for p in params if not p.requires_grad] + quant_state_tensors(model)
    grads = [p.grad for p in trainable if p.grad is not None]
    state = optimizer_state_tensors(opt)
    # full fine-tuning: the stored weights, and DPO's frozen reference copy
    weights = storage_bytes(frozen if case.method != "full" else params + quant_state_tensors(model))
    trainable_state = storage_bytes((trainable if case.method != "full" else []) + grads + state)
    buffers = list(model.buffers()) + (list(reference.buffers()) if reference is not model else [])
    held = storage_bytes(params + quant_state_tensors(model) + grads + state + buffers)

    # step 2, measured: saved tensors from the first decoder layer to the final norm, live bytes throughout
    layers, backbone, head = _decoder_layers(model)
    exclude = params + quant_state_tensors(model)
    saved = SavedBytes(exclude)
    final: dict[str, Any] = {}
    calls = {"backbone": 0, "norm": 0}

    # the policy's forward only (DPO's reference forward reruns the same backbone under no_grad: it saves nothing)
    def first(name: str) -> bool:
        calls[name] += 1
        return calls[name] == 1

    hooks = [
        backbone.register_forward_pre_hook(
            lambda mod, args: (first("backbone") and saved.__enter__(), None)[1]
        ),
        backbone.norm.register_forward_hook(
            lambda mod, args, out: (
                first("norm") and (saved.__exit__(None, None, None), final.update(hidden=out)),
                None,
            )[1]
        ),
        layers[0].register_forward_pre_hook(
            lambda mod, args, kwargs: (final.setdefault("mask", kwargs.get("attention_mask")), None)[1],
            with_kwargs=True,
        ),
    ]
    with LiveBytes() as live:
        if case.dpo:
            loss = dpo_step(model, reference, batch)
        else:
            loss = loss_step(model, ids, labels, case, position_ids)
        loss.backward()
    for h in hooks:
        h.remove()
    activations = saved.total
    mask = final.pop("mask", None)
    if case.checkpointing and mask is not None:
        # every checkpointed layer holds the packed rows' boolean mask as an input (by reference, not saved)
        activations += mask.numel() * mask.element_size()
    step_peak = live.peak
    del loss

    # the loss alone: from the final hidden states, forward and backward, under autocast as in the model's forward
    h = final.pop("hidden").detach().requires_grad_(True)
    autocast = contextlib.nullcontext() if case.fp32 else torch.autocast("cpu", dtype=torch.bfloat16)
    with autocast, LiveBytes() as loss_live:
        if case.dpo:  # the policy's head on both rows, the whole reference forward, the DPO loss
            loss = dpo_step(model, reference, batch, policy_hidden=h)
        else:
            loss = loss_alone(h, head, labels, case)
        loss.backward()
    # TRL's function keeps the hidden states for its backward: a view of its input on the CPU (counted here), a
    # masked copy on CUDA
    logits = loss_live.peak + (0 if case.chunked_loss else h.numel() * h.element_size())
    del loss, h
    opt.step()

    measured = dict(
        weights=weights,
        trainable_state=trainable_state,
        activations=activations,
        logits=logits,
        total=held + step_peak,
    )
    return dict(
        case=case.name,
        objective=case.objective,
        shape=case.shape,
        method=case.method,
        checkpointing=case.checkpointing,
        chunked_loss=case.chunked_loss,
        tokens=case.tokens,
        chunk_size=case.chunk_size,
        num_layers=m.num_layers,
        vocab_size=m.vocab_size,
        measured=measured,
        detail=dict(
            grads=storage_bytes(grads),
            optimizer_state=storage_bytes(state),
            held_before_step=held,
            step_peak_above_held=step_peak,
        ),
        planned=planned(case),
        seconds=round(time.time() - t0, 1),
    )


def measure_trl_tile(tokens: int = 4096, hidden: int = 64, vocab: int = 32768) -> dict[str, Any]:
    """TRL's fused head alone at a full [4096, 32768] tile on the CPU: its peak beyond the tile (compute dtype)
    and the fp32 gradient accumulators, in fp32 copies of the tile (calibration.json's cpu.trl_tile_fp32_copies)."""
    import torch
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    out: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        h = torch.randn(tokens, hidden, dtype=dtype).requires_grad_(True)
        w = torch.randn(vocab, hidden, dtype=dtype) * 0.02
        labels = torch.randint(0, vocab, (tokens,))
        with LiveBytes() as live:
            res = ChunkedLogProbFunction.apply(
                h, w, None, labels, 1.0, 32768, None, 1.0, ("log_probs", "entropy", "is_top1")
            )
            (-res[0].sum() / tokens).backward()
        c = h.element_size()
        tile = tokens * vocab
        beyond = live.peak - c * tile - 4 * tokens * hidden - (c * tokens * hidden if c != 4 else 0)
        out[name] = round(beyond / (4 * tile), 3)
    return out


# ---------------------------------------------------------------- the plan for the same shape


def planned(case: Case) -> dict[str, float]:
    """The planner's terms (bytes) for the case's exact shape, strategy and tokens, on the CPU in bf16; the total
    is the four terms and the working set above the loss peak (the overhead's fixed and allocator shares left out)."""
    from finetune.core.config import HardwareConfig, MethodConfig, TrainConfig
    from finetune.core.objectives import OBJECTIVES
    from finetune.planner import Strategy, make_job, memory, tensors_gb
    from finetune.planner.job import runtime

    m = model_config(case)
    method = MethodConfig(
        name=case.method,
        precision=case.precision,
        lora_dropout=case.dropout,
        adapter_dtype=case.adapter_dtype,
        lora_experts=bool(case.experts),
    )
    hw = HardwareConfig(name="bench", device="cpu", gpu_memory_gb=1e6)
    train = TrainConfig(seq_len=case.tokens, loss_chunk_size=case.chunk_size)
    job = make_job(m, method, hw, train, case.tokens, objective=OBJECTIVES[case.objective])
    s = Strategy(
        activation_checkpointing=case.checkpointing, chunked_loss=case.chunked_loss, micro_batch_size=1
    )
    # this script counts allocated bytes (LiveBytes), not the resident pages a run's peak RSS counts
    rt = replace(runtime(job, s), resident=False)
    mem, _ = memory(job, s, rt)
    terms = {t: getattr(mem, t) * GB for t in TERMS}
    terms["total"] = tensors_gb(job, s, rt) * GB
    terms["working_set"] = terms["total"] - sum(terms[t] for t in TERMS)
    terms["overhead"] = mem.overhead * GB
    return terms


# ---------------------------------------------------------------- whole DPO runs: the peak RSS against the plan

RUN_METHODS = ("full", "lora", "qlora")


def dpo_run(method: str, root: Path, steps: int = 4) -> dict[str, Any]:
    """`python -m finetune +recipe=tiny_dpo method=METHOD` (mode=data, then mode=train) for a few steps, as a user
    runs it on the CPU (fp32, the recipe's 32 pairs a micro-batch): metrics.json's peak (the training process's
    VmHWM, finetune/rundir/machine.py) against the plan's total, fixed share and allocator share included.

    At `train.seq_len=auto`: the plan's rows are the longest kept pair (prompt + longer answer, 44 tokens in the
    bundled set), the widest a DPO batch can be (TRL's collator pads each batch to its longest pair; nothing is
    packed). At the recipe's seq_len=64 the plan is an upper bound the batches never reach (31-42 tokens in the
    first four), which read as full fine-tuning planned 9.9% high."""
    import os
    import subprocess

    run_dir = root / f"dpo-{method}"
    args = [
        "+recipe=tiny_dpo", f"method={method}", f"run_dir={run_dir}", f"data.cache_dir={root / 'data-cache'}",
        "train.seq_len=auto", f"train.max_steps={steps}", "train.save_steps=1000", "train.eval_steps=1000", "train.report_to=[]",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    for mode in ("data", "train"):
        proc = subprocess.run(
            [sys.executable, "-m", "finetune", f"mode={mode}", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"dpo {method} mode={mode} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    train = json.loads((run_dir / "metrics.json").read_text())["train"]
    plan = json.loads((run_dir / "plan.json").read_text())
    return dict(
        method=method,
        precision=train["precision"],
        micro_batch_size=plan["strategy"]["micro_batch_size"],
        seq_len=plan["seq_len"],
        planned_gb=plan["gpu_memory_gb"],
        measured_gb=train["peak_memory_gb"],
        seconds=round(time.time() - t0, 1),
    )


def run_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | precision | pairs a micro-batch | seq_len | planned: tensors + fixed + allocator | planned total"
        " | measured peak RSS | error |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        g = r["planned_gb"]
        tensors = g["weights"] + g["trainable_state"] + g["activations"] + g["logits"]
        e = error(r["measured_gb"], g["total"])
        lines.append(
            f"| {r['method']} | {r['precision']} | {r['micro_batch_size']} | {r['seq_len']} | "
            f"{tensors:.3f} + {g['overhead']:.3f} | {g['total']:.3f} GB | {r['measured_gb']:.3f} GB | "
            f"{'-' if e is None else f'{e:+.1%}'} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- report


def error(measured: float, plan: float) -> Optional[float]:
    return None if measured == 0 else (plan - measured) / measured


def _cell(measured: float, plan: float) -> str:
    e = error(measured, plan)
    err = "-" if e is None else f"{e:+.1%}"
    return f"{measured / MB:,.2f} / {plan / MB:,.2f} ({err})"


def table(rows: list[dict[str, Any]]) -> str:
    head = "| shape | case | tokens | " + " | ".join(TERMS) + " | total |"
    lines = [head, "|---|---|---:|" + "---:|" * (len(TERMS) + 1)]
    for r in rows:
        layers = f"{r['num_layers']} layer{'s' if r['num_layers'] > 1 else ''}"
        shape = r["shape"] + ("" if r["shape"] == "tiny" else f" ({layers}, vocab {r['vocab_size']:,})")
        cells = [_cell(r["measured"][t], r["planned"][t]) for t in (*TERMS, "total")]
        lines.append(f"| {shape} | {r['case']} | {r['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def worst(rows: list[dict[str, Any]]) -> dict[str, tuple[float, str]]:
    """The largest error per term over all rows."""
    out: dict[str, tuple[float, str]] = {}
    for t in (*TERMS, "total"):
        errs = [
            (abs(e), f"{r['shape']} {r['case']}")
            for r in rows
            if (e := error(r["measured"][t], r["planned"][t])) is not None
        ]
        out[t] = max(errs) if errs else (0.0, "-")
    return out


def environment() -> str:
    import torch
    import transformers

    try:
        import peft

        peft_version = peft.__version__
    except ImportError:
        peft_version = "-"
    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except ImportError:
        bnb_version = "-"
    import os

    return (
        f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft_version}, "
        f"bitsandbytes {bnb_version}"
    )


def report(env: str, rows: list[dict[str, Any]]) -> None:
    print(env)
    print(
        "cells: measured / planned MB (planned error vs measured); total = everything held + the step's peak;"
    )
    print("planned total = the four terms + the backward working set, without the CUDA context and the")
    print("allocator share (not measurable on a CPU)\n")
    print(table(rows))
    w = worst(rows)
    print("\nworst error per term:")
    print(", ".join(f"{t} {e:.1%} ({where})" for t, (e, where) in w.items()))
    missed = [
        f"{r['shape']} {r['case']} {e:+.1%}"
        for r in rows
        if (e := error(r["measured"]["total"], r["planned"]["total"])) is not None and abs(e) > TOTAL_TARGET
    ]
    ok = all(e <= TERM_TARGET for t, (e, _) in w.items() if t != "total") and not missed
    print(
        f"targets (each term within {TERM_TARGET:.0%}, total within {TOTAL_TARGET:.0%}): {'met' if ok else 'NOT met'}"
        + (f"; totals outside: {', '.join(missed)}" if missed else "")
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--only", help="run only cases whose shape or name contains this")
    parser.add_argument(
        "--runs", action="store_true", help="also the whole DPO runs (peak RSS against the plan; minutes)"
    )
    parser.add_argument(
        "--report", type=Path, help="print the report of an earlier --json run, measuring nothing"
    )
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        report(saved["environment"], saved["rows"])
        if saved.get("dpo_runs"):
            print("\n" + run_table(saved["dpo_runs"]))
        return 0

    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for case in cases(args.quick):
        if args.only and args.only not in f"{case.shape} {case.name}":
            continue
        r = measure(case)
        rows.append(r)
        e = error(r["measured"]["total"], r["planned"]["total"])
        print(
            f"  {case.shape:13s} {case.name:22s} total error {e:+.1%}  ({r['seconds']}s)",
            file=sys.stderr,
            flush=True,
        )
    report(environment(), rows)
    runs: list[dict[str, Any]] = []
    if args.runs or (not args.quick and (not args.only or "dpo" in args.only)):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="bench-planner-dpo-") as tmp:
            for method in RUN_METHODS:
                runs.append(dpo_run(method, Path(tmp)))
                print(f"  dpo run {method}: {runs[-1]['seconds']}s", file=sys.stderr, flush=True)
        print(
            "\nDPO runs (python -m finetune +recipe=tiny_dpo, 4 steps, one process): the plan's total against"
        )
        print("metrics.json's peak (the training process's VmHWM)\n")
        print(run_table(runs))
    trl_tile = None
    if not args.quick and not args.only:
        trl_tile = measure_trl_tile()
        print(f"\nTRL's tile folding on the CPU, beyond the tile and the accumulators: {trl_tile} fp32 tiles")
    if args.json:
        payload = dict(environment=environment(), rows=rows, dpo_runs=runs, trl_tile_fp32_copies=trl_tile)
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
