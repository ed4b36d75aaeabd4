"""Planner accuracy on CPU: the memory of a real training step, term by term, against the plan.

    /tmp/venv/bin/python scripts/bench_planner.py                # tiny + one decoder layer at 8B and 70B dims (minutes)
    /tmp/venv/bin/python scripts/bench_planner.py --quick        # tiny model only (~1 min), used by the tests
    /tmp/venv/bin/python scripts/bench_planner.py --json out.json

For each case a Llama-architecture model is built from a model config (random
init: configs/model/tiny.yaml as it is; Llama-3.1-8B and -70B with one decoder
layer and a 8,192-token vocabulary, the planner given the same shape), prepared
as DESIGN.md's memory model has it (full: bf16 weights and gradients, an fp32
master copy and fp32 AdamW moments, 16 bytes a parameter; LoRA: frozen bf16
base, PEFT adapters in fp32, dropout 0.05; QLoRA: the same on a bitsandbytes
NF4 base, quantized on the CPU, embeddings/head/norms in bf16). Two rows show
finetune/train/models.py's own preparation ("trainer path"): QLoRA through
`prepare_kbit_model` (PEFT's `prepare_model_for_kbit_training` with its fp32
upcast undone); full fine-tuning with fp32 weights under bf16 autocast, which
the planner models for runs without DeepSpeed or FSDP (the DESIGN.md rows are
planned as DeepSpeed's layout). Every row counts for the targets. Zero gradients and one optimizer step on them
create the state a step in progress holds (gradients kept, as under gradient
accumulation; Adam moments; master weights); then one real forward and
backward is measured, and the optimizer steps:

- weights, trainable state: bytes of the distinct storages of the parameters
  (4-bit data and quantization constants included), gradients and optimizer
  state (AdamW moments and the fp32 master copy), held across steps;
- activations: storages autograd saves during the forward
  (`saved_tensors_hooks`, each storage once, parameters excluded); with
  checkpointing, each layer's input (the layer being recomputed, measured by
  running layer 0 without checkpointing on its real input, is transient: the
  planner counts it in the overhead's working set, and it shows in the total);
- logits: the peak of live tensor bytes above the start of the loss step
  (LM head + loss, forward and backward, from the final hidden states), plain
  transformers loss or our chunked loss;
- total: the bytes held before the step plus the peak of live tensor bytes
  during its forward and backward (a TorchDispatchMode tracks every storage an
  op creates and frees), gradients kept between steps (as under gradient
  accumulation).

The planned total is the four terms plus the overhead term's backward working
set (one layer's activation gradients, and with checkpointing the layer being
recomputed, beyond the loss peak); it leaves out the
overhead's fixed CUDA context and allocator share, which a CPU cannot measure
(scripts/gpu_check.py measures them on a GPU). Targets: each term within 10%,
the total within 5%.
"""

from __future__ import annotations

import argparse
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
TERMS = ("weights", "trainable_state", "activations", "logits")
TERM_TARGET, TOTAL_TARGET = 0.10, 0.05
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Case:
    shape: str  # tiny | llama3_1_8b | llama3_1_70b
    method: str  # full | lora | qlora
    checkpointing: bool
    chunked_loss: bool
    tokens: int
    chunk_size: int
    num_layers: Optional[int] = None  # None: the model config's own
    vocab_size: Optional[int] = None
    # True: as finetune/train/models.py prepares it (QLoRA: `prepare_kbit_model`; full: fp32 weights under
    # bf16 autocast, planned as such, see finetune.planner.core._fp32_autocast).
    trainer_path: bool = False

    @property
    def name(self) -> str:
        parts = [
            self.method,
            "ckpt" if self.checkpointing else "",
            "chunked" if self.chunked_loss else "plain",
        ]
        name = " ".join(p for p in parts if p)
        return name + (" (trainer path)" if self.trainer_path else "")


def model_config(case: Case) -> Any:
    """The ModelConfig of configs/model/<shape>.yaml, with the case's layers and vocabulary."""
    import yaml

    from finetune.config import ModelConfig, package_dir

    raw = yaml.safe_load((package_dir("configs") / "model" / f"{case.shape}.yaml").read_text())
    m = ModelConfig(**raw)
    changes: dict[str, Any] = {}
    if case.num_layers is not None:
        changes["num_layers"] = case.num_layers
    if case.vocab_size is not None:
        changes["vocab_size"] = case.vocab_size
    return replace(m, **changes)


def cases(quick: bool) -> list[Case]:
    out = []
    for method in ("full", "lora", "qlora"):
        for ckpt in (False, True):
            for chunked in (False, True):
                out.append(Case("tiny", method, ckpt, chunked, tokens=256, chunk_size=64))
    out.append(Case("tiny", "qlora", False, False, tokens=256, chunk_size=64, trainer_path=True))
    for ckpt, chunked in ((False, False), (False, True), (True, False), (True, True)):
        out.append(Case("tiny", "full", ckpt, chunked, tokens=256, chunk_size=64, trainer_path=True))
    if quick:
        return out
    # One decoder layer (two without checkpointing) and a 8,192-token vocabulary (the planner gets the same shape), few tokens: without
    # AVX512-BF16 the bf16 backward matmuls are pathologically slow (83 s for the input gradient of one 8B MLP
    # projection at 64 tokens on the 2 shared cores here; the per-token figures do not depend on the token
    # count). Adapter methods only: full fine-tuning also needs the base's weight gradients (as slow), and 70B's
    # one layer would hold 16 GB of training state; the tiny model covers it.
    big = dict(num_layers=1, vocab_size=8192)
    # two layers without checkpointing: the first layer's input needs no gradient and it keeps ~14% less
    # than the planner's per-layer figure (exact for every later layer)
    out.append(
        Case("llama3_1_8b", "lora", False, False, tokens=16, chunk_size=8, num_layers=2, vocab_size=8192)
    )
    out.append(Case("llama3_1_8b", "lora", True, True, tokens=16, chunk_size=8, **big))
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


class MasterAdamW:
    """bf16 weights and gradients, an fp32 master copy and fp32 AdamW moments (DESIGN.md's 2+2+4+8 bytes)."""

    def __init__(self, params: list[Any], lr: float = 1e-5) -> None:
        import torch

        self.params = params
        self.master = [p.detach().float() for p in params]
        self.inner = torch.optim.AdamW(self.master, lr=lr, foreach=False)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                continue
            m.grad = p.grad.float()  # one parameter's fp32 gradient at a time
            self.inner.step()
            m.grad = None
            p.data.copy_(m)

    def zero_grad(self, set_to_none: bool = False) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_() if not set_to_none else setattr(p, "grad", None)

    def state_tensors(self) -> list[Any]:
        return self.master + [v for s in self.inner.state.values() for v in s.values()]


def optimizer_state_tensors(opt: Any) -> list[Any]:
    import torch

    if isinstance(opt, MasterAdamW):
        return opt.state_tensors()
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def build_model(
    m: Any, method: str, checkpointing: bool, trainer_path: bool = False, dropout: float = 0.05
) -> Any:
    """A random-init LlamaForCausalLM of `m`'s dimensions, bf16, prepared for `method` as DESIGN.md models it.

    `trainer_path`: as finetune/train/models.py prepares it instead (see `Case.trainer_path`).
    """
    import torch
    from measure_activations import _init_, _to_qlora
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from finetune.tiny import hf_config

    cfg = hf_config(m)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device="cpu")
    _init_(model)
    if trainer_path and method == "full":
        model = model.float()  # fp32 weights; bf16 autocast around the forward, as accelerate applies it
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)  # buffers are not initialised by to_empty
    model.train()
    if method == "full":
        model.requires_grad_(True)
    else:
        if method == "qlora":
            for layer in model.model.layers:
                _to_qlora(layer)
            if trainer_path:
                from finetune.train.models import prepare_kbit_model

                # the trainer's own preparation (PEFT's, with its fp32 upcast of the 16-bit weights undone)
                model = prepare_kbit_model(model, torch.bfloat16)
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        lcfg = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=dropout,
            target_modules=LORA_TARGETS,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lcfg, autocast_adapter_dtype=True)  # fp32 adapters: PEFT's default
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _decoder_layers(model: Any) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers, base.model, base.lm_head


def loss_step(model: Any, ids: Any, labels: Any, case: Case) -> Any:
    """Forward to the loss as the trainer does (finetune/train/trainer.py), returning (loss, final hidden states)."""
    import torch

    from finetune.train.chunked_loss import chunked_causal_lm_loss

    if case.chunked_loss:
        out = model(
            input_ids=ids,
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=torch.empty(0, dtype=torch.long),
        )
        hidden = out.hidden_states[-1]
        head = model.get_output_embeddings()
        return chunked_causal_lm_loss(hidden, head.weight, labels, chunk_size=case.chunk_size), hidden
    captured: dict[str, Any] = {}
    _, _, head = _decoder_layers(model)
    handle = head.register_forward_pre_hook(lambda mod, args: captured.__setitem__("hidden", args[0]))
    try:
        out = model(input_ids=ids, labels=labels, use_cache=False)
    finally:
        handle.remove()
    return out.loss, captured["hidden"]


def measure(case: Case) -> dict[str, Any]:
    """One measured training step of `case` with its state already held (bytes per term, and the total peak)."""
    import torch
    from measure_activations import SavedBytes
    from transformers.loss.loss_utils import ForCausalLMLoss

    m = model_config(case)
    torch.manual_seed(0)
    t0 = time.time()
    model = build_model(m, case.method, case.checkpointing, case.trainer_path)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if case.method == "full" and not case.trainer_path:
        opt: Any = MasterAdamW(trainable)
    else:
        opt = torch.optim.AdamW(trainable, foreach=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.vocab_size, (1, case.tokens), generator=g)
    labels = ids.clone()

    # Zero gradients and one optimizer step on them create the held state of a step in progress (gradients kept,
    # as under gradient accumulation; Adam moments and master weights) without a second, unmeasured backward:
    # bf16 backward matmuls are very slow on CPUs without AVX512-BF16.
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)

    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad] + quant_state_tensors(model)
    grads = [p.grad for p in trainable if p.grad is not None]
    state = optimizer_state_tensors(opt)
    weights = storage_bytes(frozen if case.method != "full" else params + quant_state_tensors(model))
    trainable_state = storage_bytes((trainable if case.method != "full" else []) + grads + state)
    held = storage_bytes(params + quant_state_tensors(model) + grads + state + list(model.buffers()))

    # step 2, measured: saved tensors from the first decoder layer to the LM head, live bytes throughout
    layers, backbone, head = _decoder_layers(model)
    exclude = params + quant_state_tensors(model)
    saved = SavedBytes(exclude)
    layer0_input: dict[str, Any] = {}
    hooks = [
        backbone.register_forward_pre_hook(lambda mod, args: (saved.__enter__(), None)[1]),
        head.register_forward_hook(lambda mod, args, out: saved.__exit__(None, None, None)),
    ]
    if case.checkpointing:
        hooks.append(
            layers[0].register_forward_pre_hook(
                lambda mod, args, kwargs: layer0_input.update(args=args, kwargs=kwargs), with_kwargs=True
            )
        )
    with LiveBytes() as live:
        loss, hidden = loss_step(model, ids, labels, case)
        loss.backward()
    for h in hooks:
        h.remove()
    activations = saved.total
    step_peak = live.peak
    del loss

    recomputed = 0
    if case.checkpointing:
        # the layer being recomputed in backward holds its full saved tensors meanwhile (part of the total)
        layer = layers[0]
        layer.gradient_checkpointing = False
        with SavedBytes(exclude) as one:
            out = layer(*layer0_input["args"], **layer0_input["kwargs"])
        layer.gradient_checkpointing = True
        recomputed = one.total
        del out, layer0_input

    # the loss step alone: LM head + loss, forward and backward, from the final hidden states
    from finetune.train.chunked_loss import chunked_causal_lm_loss

    h = hidden.detach().requires_grad_(True)
    del hidden
    autocast = torch.autocast(
        "cpu", dtype=torch.bfloat16, enabled=case.trainer_path and case.method == "full"
    )
    with autocast:
        if not case.chunked_loss:
            # Under autocast the head's bf16 weight copy exists from the model's forward on (an activation,
            # measured above); fill autocast's cast cache first so the loss step below reuses it.
            head(h[:, :1]).sum()
        with LiveBytes() as loss_live:
            if case.chunked_loss:
                with torch.autocast("cpu", enabled=False):  # the trainer runs it outside autocast
                    loss = chunked_causal_lm_loss(h, head.weight, labels, chunk_size=case.chunk_size)
            else:
                logits = head(h)  # the plain loss runs inside the model's (autocast) forward
                loss = ForCausalLMLoss(logits, labels, vocab_size=m.vocab_size)
                del logits  # the model's output is dropped before backward, as in the trainer
            loss.backward()
    logits = loss_live.peak
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
            recomputed_layer=recomputed,
        ),
        planned=planned(case),
        seconds=round(time.time() - t0, 1),
    )


# ---------------------------------------------------------------- the plan for the same shape


def planned(case: Case) -> dict[str, float]:
    """The planner's terms (bytes) for the case's exact shape, strategy and tokens; overhead left out of the total."""
    from finetune.config import HardwareConfig, MethodConfig, TrainConfig
    from finetune.planner import core
    from finetune.planner.params import count_params, lora_params

    m = model_config(case)
    method = MethodConfig(name=case.method, precision="bf16", lora_dropout=0.05, adapter_dtype="fp32")
    hw = HardwareConfig(name="bench", device="cuda", gpu_memory_gb=1e6)
    train = TrainConfig(seq_len=case.tokens, loss_chunk_size=case.chunk_size)
    adapter = lora_params(m, method) if method.uses_adapters else 0
    job = core._Job(m, method, hw, train, case.tokens, count_params(m), adapter, core.Calibration.default())
    s = core.Strategy(
        # full fine-tuning: DESIGN.md's layout (bf16 working weights, fp32 master) is DeepSpeed's, here on
        # one GPU; the trainer path (no engine) is fp32 weights under autocast (core._fp32_autocast)
        sharding="zero3" if case.method == "full" and not case.trainer_path else "none",
        optimizer="adamw",
        activation_checkpointing=case.checkpointing,
        chunked_loss=case.chunked_loss,
        micro_batch_size=1,
    )
    mem, _ = core._memory(job, s)
    terms = {t: getattr(mem, t) * core.GB for t in TERMS}
    fixed = job.cal.cuda_context_gb * core.GB
    allocator = job.cal.allocator_fraction * sum(terms.values())
    # the overhead's backward working set is live tensor bytes, measured here; the CUDA context and the
    # allocator's share are not (see the docstring)
    terms["working_set"] = mem.overhead * core.GB - fixed - allocator
    terms["total"] = sum(terms.values())
    terms["overhead"] = mem.overhead * core.GB
    return terms


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
        "--report", type=Path, help="print the report of an earlier --json run, measuring nothing"
    )
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        report(saved["environment"], saved["rows"])
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
    if args.json:
        args.json.write_text(json.dumps(dict(environment=environment(), rows=rows), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
