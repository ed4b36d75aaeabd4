"""GPU check: peak memory of real training steps against the plan, tokens/s and MFU, on one GPU.

    python scripts/gpu_check.py OUT_DIR                  # on a GPU machine (scripts/gpu_check.sh wraps this)
    python scripts/gpu_check.py OUT_DIR --cpu            # the same code path on tiny shapes on the CPU (peak = RSS)
    python scripts/gpu_check.py OUT_DIR --budget-s 420 --steps 4

No model hub: every model is random-init from its architecture config
(configs/model/*.yaml), built and run as finetune/train runs it (full: fp32
weights, here with bitsandbytes AdamW8bit; LoRA: frozen bf16 base and fp32 PEFT
adapters; QLoRA: NF4 base through `prepare_kbit_model` and bf16 adapters; bf16
autocast around the forward, as accelerate applies it; packed rows, whose
position_ids make transformers build a block-diagonal mask), with one of the
trainer's loss paths: the project's chunked loss inside the model's forward or
TRL's fused LM head. Each case names what it ran (`autocast`, `packed`,
`adapter_dtype`, `lora_dropout`, `harness`), and the planner is evaluated for
exactly that. Each case runs in its own process (a clean
CUDA context, its own peak) for a few steps; the first is warm-up. Recorded per
case: torch.cuda.max_memory_allocated and max_memory_reserved, the device
memory in use (reserved + CUDA context), the planner's terms for the same
shape and strategy, tokens/s and MFU (model FLOPs: 6N a token for full
fine-tuning, 4N with frozen weights, plus attention; over the card's dense bf16
peak). A case that would exceed the remaining time budget is skipped and the
table says so. Writes OUT_DIR/results.md and OUT_DIR/results.json;
scripts/calibrate.py refits the planner's constants from the json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

GB = 1e9
TERMS = ("weights", "trainable_state", "activations", "logits", "overhead")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Each case: model config (and dims overridden), method, optimizer, seq_len, strategy, and est_s, the
# expected wall time (process start, build, steps); a case is skipped when less than that is left.
HARNESS = "gpu_check-v2"  # trainer paths; v1 (the stored H200 rows) ran no autocast, no packing, plain loss
# First: the case that decides what the allocator's reserved-but-unused share scales with: a 65 GB
# frozen base with about 6 GB that a step allocates and frees. Scaled by every term the share would be ~3 GB,
# by the fluctuating bytes ~1 GB (scripts/calibrate.py --residuals; calibration.json's cuda notes).
GPU_CASES: list[dict[str, Any]] = [
    dict(name="32b-lora-8k", model="qwen2_5_32b", method="lora", seq_len=8192, checkpointing=True, chunked_loss=True, est_s=120),
    dict(name="8b-lora-2k", model="llama3_1_8b", method="lora", seq_len=2048, checkpointing=False, chunked_loss=True, est_s=45),
    dict(name="8b-lora-8k", model="llama3_1_8b", method="lora", seq_len=8192, checkpointing=True, chunked_loss=True, est_s=50),
    dict(name="8b-lora-8k-trl", model="llama3_1_8b", method="lora", seq_len=8192, checkpointing=True, chunked_loss=False, est_s=55),
    dict(name="8b-qlora-8k", model="llama3_1_8b", method="qlora", seq_len=8192, checkpointing=True, chunked_loss=True, est_s=60),
    dict(name="8b-full-8bit-2k", model="llama3_1_8b", method="full", optimizer="adamw_8bit", seq_len=2048, checkpointing=True, chunked_loss=True, est_s=75),
    dict(name="70b-4layers-lora-4k", model="llama3_1_70b", num_layers=4, method="lora", seq_len=4096, checkpointing=False, chunked_loss=True, est_s=50),
    # TRL's activation offloading at a long length (no GPU measurement of it yet);
    # the plan moves all but 2 layers' checkpointed inputs to host memory, the check measures what stays
    dict(name="8b-lora-64k-offload", model="llama3_1_8b", method="lora", seq_len=65536, checkpointing=True, chunked_loss=True, activation_offloading=True, packed=False, est_s=150),
]  # fmt: skip
CPU_CASES: list[dict[str, Any]] = [
    dict(name="tiny-lora", model="tiny", method="lora", seq_len=128, checkpointing=False, chunked_loss=False, est_s=60),
    dict(name="tiny-qlora-ckpt", model="tiny", method="qlora", seq_len=128, checkpointing=True, chunked_loss=True, est_s=60),
    dict(name="tiny-full-8bit", model="tiny", method="full", optimizer="adamw_8bit", seq_len=128, checkpointing=True, chunked_loss=True, est_s=60),
]  # fmt: skip


def trainer_case(case: dict[str, Any]) -> dict[str, Any]:
    """The case with what the trainer runs spelled out (what results.json records and the plan is evaluated for)."""
    defaults = dict(
        harness=HARNESS,
        autocast=True,
        packed=True,
        adapter_dtype="bf16" if case["method"] == "qlora" else "fp32",
        lora_dropout=0.05,
        micro_batch_size=1,
    )
    return {**defaults, **case}


# ---------------------------------------------------------------- the plan for a case


def model_config(case: dict[str, Any]) -> Any:
    import yaml

    from finetune.core.composition import package_dir
    from finetune.core.config import ModelConfig

    raw = yaml.safe_load((package_dir("configs") / "model" / f"{case['model']}.yaml").read_text())
    m = ModelConfig(**raw)
    dims = {k: case[k] for k in ("num_layers", "vocab_size") if case.get(k) is not None}
    return replace(m, **dims) if dims else m


@functools.lru_cache(maxsize=1)
def _profiles() -> dict[str, Any]:
    from finetune.core.composition import load_profiles

    return load_profiles()


def hardware(case: dict[str, Any]) -> Any:
    """The profile the case ran on: a named GPU profile, or the CPU with its RAM as 'GPU memory'."""
    from finetune.core.config import HardwareConfig

    hw = case["hardware"]
    if hw == "cpu":
        return HardwareConfig(name="cpu", device="cpu", gpu_memory_gb=case.get("host_memory_gb") or 1e3)
    return _profiles()[hw]


def plan_terms(case: dict[str, Any], calibration: Any = None) -> Optional[dict[str, float]]:
    """The planner's per-GPU terms (GB) for the case's exact shape, strategy and runtime, and their total.

    The runtime is the trainer's for the case (finetune.planner.runtime), with the case's own `autocast`
    and `packed` (what its harness ran). `tensors`: what max_memory_allocated should show, the four terms
    plus the overhead's working set above the loss peak, without the fixed share and the allocator's;
    `fluctuating`: what a step allocates and frees, which the allocator's share scales with.
    None for a loss path no plan takes (`loss: transformers`, the plain loss of the first GPU check).
    """
    from finetune.core.config import MethodConfig, TrainConfig
    from finetune.planner import Strategy, make_job, memory, runtime, tensors_gb
    from finetune.planner.memory import fluctuating

    if case.get("loss") == "transformers":
        return None
    m = model_config(case)
    method = MethodConfig(
        name=case["method"],
        precision="bf16",
        optimizer=case.get("optimizer", "adamw"),
        adapter_dtype=case.get("adapter_dtype", "fp32" if case["method"] == "lora" else "bf16"),
        lora_dropout=case.get("lora_dropout", 0.05),
    )
    train = TrainConfig(seq_len=case["seq_len"], loss_chunk_size=case.get("chunk_size", 1024))
    job = make_job(m, method, hardware(case), train, case["seq_len"], calibration)
    s = Strategy(
        optimizer=case.get("optimizer", "adamw"),
        activation_checkpointing=case["checkpointing"],
        chunked_loss=case["chunked_loss"],
        micro_batch_size=case.get("micro_batch_size", 1),
        activation_offloading=case.get("activation_offloading", False),
    )
    rt = runtime(job, s)
    autocast = case.get("autocast", rt.autocast)
    rt = replace(
        rt, autocast=autocast, fp32_residual=rt.fp32_residual and autocast, packed=case.get("packed", True)
    )
    mem, _ = memory(job, s, rt)
    out = {t: getattr(mem, t) for t in TERMS}
    out["total"] = mem.total
    out["tensors"] = tensors_gb(job, s, rt)
    out["fluctuating"] = fluctuating(job, s, rt) / GB
    return out


def executed_flops(case: dict[str, Any], calibration: Any = None) -> float:
    """The FLOPs a token executes in the case (recomputation, TRL's extra), as the planner's time estimate counts."""
    from finetune.core.config import MethodConfig, TrainConfig
    from finetune.planner import Strategy, executed_flops_per_token, make_job

    m = model_config(case)
    method = MethodConfig(name=case["method"], precision="bf16", optimizer=case.get("optimizer", "adamw"))
    train = TrainConfig(seq_len=case["seq_len"])
    job = make_job(m, method, hardware(case), train, case["seq_len"], calibration)
    s = Strategy(activation_checkpointing=case["checkpointing"], chunked_loss=case["chunked_loss"])
    return executed_flops_per_token(job, s)


def model_flops_per_token(case: dict[str, Any]) -> float:
    """Model FLOPs a token (MFU's numerator): 6 a weight (full) or 4 (frozen), attention; no recomputation."""
    from finetune.planner import model_flops_per_token as flops

    return flops(model_config(case), case["method"], case["seq_len"])


# ---------------------------------------------------------------- one case, in its own process


def _rss_peak_bytes() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmHWM"].split()[0]) * 1024


def build(case: dict[str, Any], device: str) -> tuple[Any, Any]:
    """The model and optimizer for the case, random-init on `device`, prepared and patched as the trainer does."""
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from finetune.modeling.chunked_loss import add_chunked_loss_head
    from finetune.modeling.tiny import hf_config

    m = model_config(case)
    qwen2 = m.architecture == "qwen2"
    model_cls, rotary_cls = (
        (Qwen2ForCausalLM, Qwen2RotaryEmbedding) if qwen2 else (LlamaForCausalLM, LlamaRotaryEmbedding)
    )
    cfg = hf_config(m, max_position_embeddings=max(m.max_position_embeddings, case["seq_len"]))
    cfg._attn_implementation = "sdpa"
    full = case["method"] == "full"
    dtype = torch.float32 if full else torch.bfloat16  # full: fp32 weights under bf16 autocast (models.py)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    model.model.rotary_emb = rotary_cls(cfg).to(device)
    model.train()
    if not case["chunked_loss"]:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # as SFTTrainer, before PEFT
    if case["method"] == "qlora":
        _quantize_linears(model, device)
        from finetune.modeling.loading import prepare_kbit_model

        model = prepare_kbit_model(model, torch.bfloat16)  # the trainer's preparation
    if case["method"] in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        lcfg = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=case["lora_dropout"],
            target_modules=LORA_TARGETS,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lcfg, autocast_adapter_dtype=case["adapter_dtype"] == "fp32")
        if case["adapter_dtype"] == "bf16":
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    if case["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    add_chunked_loss_head(model, case.get("chunk_size", 1024))
    if case["autocast"]:
        # bf16 autocast around the model's forward, as accelerate applies it under the Trainer (bf16=True)
        model.forward = torch.autocast(device_type=device, dtype=torch.bfloat16)(model.forward)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if case.get("optimizer") == "adamw_8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(trainable, lr=1e-5)
    else:
        opt = torch.optim.AdamW(trainable, lr=1e-5, fused=device == "cuda")
    return model, opt


def _quantize_linears(model: Any, device: str) -> None:
    """Every projection of every decoder layer as a bitsandbytes NF4 Linear4bit (double quantization)."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=True,
                    quant_type="nf4",
                    device="meta",
                )
                q.weight = bnb.nn.Params4bit(
                    child.weight.data.to("cpu" if device == "cpu" else child.weight.device),
                    requires_grad=False,
                    quant_type="nf4",
                    compress_statistics=True,
                )
                q = q.to(device)  # quantizes
                if hasattr(q, "support_avx512bf16_for_cpu"):
                    q.support_avx512bf16_for_cpu = False
                setattr(parent, name, q)
                del child


def run_case(case: dict[str, Any], steps: int) -> dict[str, Any]:
    """Build, train `steps` steps, and measure; runs in a fresh process (see main)."""
    import torch
    from bench_planner import Case, loss_step, packed_position_ids

    device = "cpu" if case["hardware"] == "cpu" else "cuda"
    cuda = device == "cuda"
    deadline = time.time() + case["deadline_s"]
    t0 = time.time()
    model, opt = build(case, device)
    build_s = time.time() - t0
    m = model_config(case)
    spec = Case(
        case["model"], case["method"], case["checkpointing"], case["chunked_loss"], case["seq_len"],
        case.get("chunk_size", 1024),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.vocab_size, (1, case["seq_len"]), generator=g).to(device)
    position_ids = packed_position_ids(case["seq_len"]).to(device) if case["packed"] else None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the build's freed blocks (bf16 weights before quantization) are not the step's
        torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    losses: list[float] = []
    done = 0
    offload = contextlib.nullcontext
    if case.get("activation_offloading"):
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        offload = functools.partial(
            get_act_offloading_ctx_manager, model
        )  # what TRL's trainer wraps a step in
    for i in range(steps):
        t = time.time()
        with offload():
            loss = loss_step(model, ids, ids, spec, position_ids)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if cuda:
            torch.cuda.synchronize()
        done = i + 1
        times.append(time.time() - t)
        if time.time() + times[-1] > deadline:
            break
    result: dict[str, Any] = dict(status="ok", steps=done, build_s=round(build_s, 1), losses=losses)
    timed = times[1:] or times
    step_s = sum(timed) / len(timed)
    result["step_s"] = round(step_s, 4)
    result["tokens_per_s"] = round(case["seq_len"] / step_s, 1)
    peak_tflops = case.get("peak_bf16_tflops")
    result["mfu"] = (
        round(result["tokens_per_s"] * model_flops_per_token(case) / (peak_tflops * 1e12), 4)
        if peak_tflops
        else None
    )
    if cuda:
        free, total = torch.cuda.mem_get_info()
        reserved_now = torch.cuda.memory_reserved()
        result["max_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
        result["max_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
        # what the device holds beyond PyTorch's cache: the CUDA context, cuBLAS workspaces, NCCL if any
        result["context_gb"] = (total - free - reserved_now) / GB
        result["device_peak_gb"] = result["max_reserved_gb"] + result["context_gb"]
    else:
        result["rss_peak_gb"] = _rss_peak_bytes() / GB
        result["device_peak_gb"] = result["rss_peak_gb"]
    return result


# ---------------------------------------------------------------- the driver


def detect_gpu() -> dict[str, Any]:
    """The profile matching the visible GPU (by name, else by memory), and its facts."""
    import torch

    from finetune.core.composition import load_profiles

    name = torch.cuda.get_device_name(0)
    memory_gb = torch.cuda.get_device_properties(0).total_memory / GB
    profiles = {k: p for k, p in load_profiles().items() if p.device == "cuda" and p.gpus_per_node == 1}
    match = [k for k in profiles if k.upper() in name.upper().replace(" ", "")]
    if not match:
        match = [min(profiles, key=lambda k: abs((profiles[k].gpu_memory_gb or 0) - memory_gb))]
    profile = profiles[match[0]]
    return dict(
        name=name,
        memory_gb=round(memory_gb, 1),
        profile=profile.name,
        peak_bf16_tflops=profile.peak_bf16_tflops,
    )


def estimate_fits(case: dict[str, Any], device_gb: float) -> bool:
    terms = plan_terms(case)
    return terms is None or terms["total"] <= device_gb


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "trl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "-"
    return out


def _error(plan: float, measured: Optional[float]) -> Optional[float]:
    return None if not measured else round((plan - measured) / measured, 4)


def summarize(case: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    plan = plan_terms(case)
    row = dict(
        case=case, result=res, plan_gb=None if plan is None else {k: round(v, 4) for k, v in plan.items()}
    )
    if res.get("status") == "ok" and plan is not None:
        if "max_allocated_gb" in res:
            row["error_allocated_vs_terms"] = _error(plan["tensors"], res["max_allocated_gb"])
        row["error_device_vs_total"] = _error(plan["total"], res["device_peak_gb"])
    return row


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    gpu = meta.get("gpu") or {}
    lines = [
        f"# GPU check: {gpu.get('name', 'CPU (--cpu, tiny shapes)')}",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}; profile: {meta['profile']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
        f"- command: `{meta['command']}`",
        f"- wall time: {meta['wall_s']:.0f} s",
        "",
        "Plan columns: the planner's terms for the same shape and strategy (GB); `terms` is the four terms and "
        "the overhead's working set (without the CUDA context and allocator share), compared with max_memory_allocated; `plan total` (with the CUDA context and allocator "
        "share) is compared with the device peak (max_memory_reserved + CUDA context; RSS peak on the CPU).",
        "",
        "| case | status | steps | alloc GB | reserved GB | device peak GB | plan terms GB | plan total GB "
        "| err terms vs alloc | err total vs device | weights | state | activations | logits | overhead "
        "| tokens/s | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x: Any, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x)

    for row in rows:
        c, r, p = row["case"], row["result"], row["plan_gb"] or {}
        status = r.get("status", "?") + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(
            "| "
            + " | ".join(
                [
                    c["name"],
                    status,
                    f(r.get("steps"), "{}"),
                    f(r.get("max_allocated_gb")),
                    f(r.get("max_reserved_gb")),
                    f(r.get("device_peak_gb")),
                    f(p.get("tensors")),
                    f(p.get("total")),
                    f(row.get("error_allocated_vs_terms"), "{:+.1%}"),
                    f(row.get("error_device_vs_total"), "{:+.1%}"),
                    *(f(p.get(t)) for t in TERMS),
                    f(r.get("tokens_per_s"), "{:,.0f}"),
                    f(r.get("mfu"), "{:.1%}"),
                ]
            )
            + " |"
        )
    lines.append("")
    lines.append("Errors are (plan - measured) / measured: positive means the plan is conservative.")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU, peak = RSS")
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time budget")
    parser.add_argument("--steps", type=int, default=4, help="steps per case (the first is warm-up)")
    parser.add_argument("--only", help="run only cases whose name contains this")
    parser.add_argument("--case-json", help=argparse.SUPPRESS)  # internal: run one case, print its result
    args = parser.parse_args(argv)

    if args.case_json:
        print("RESULT " + json.dumps(run_case(json.loads(args.case_json), args.steps)), flush=True)
        return 0

    start = time.time()
    if args.cpu:
        gpu, device, profile, cases = None, "cpu", "cpu", CPU_CASES
    else:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device visible: run with --cpu for the tiny CPU check", file=sys.stderr)
            return 2
        gpu = detect_gpu()
        device, profile, cases = "cuda", gpu["profile"], GPU_CASES
    host_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    rows: list[dict[str, Any]] = []
    for base in cases:
        if args.only and args.only not in base["name"]:
            continue
        case = trainer_case(dict(base, hardware=profile, host_memory_gb=host_gb))
        if gpu:
            case["peak_bf16_tflops"] = gpu["peak_bf16_tflops"]
        left = args.budget_s - (time.time() - start)
        if gpu and not estimate_fits(case, gpu["memory_gb"]):
            res: dict[str, Any] = dict(status="skipped", reason="the plan does not fit this GPU")
        elif left < case["est_s"]:
            res = dict(
                status="skipped",
                reason=f"{left:.0f} s left of the budget, the case needs about {case['est_s']} s",
            )
        else:
            case["deadline_s"] = left - 20  # stop stepping early enough to report
            res = _spawn(case, args.steps, timeout=left)
        rows.append(summarize(case, res))
        print(f"{case['name']}: {json.dumps(rows[-1]['result'])[:300]}", file=sys.stderr, flush=True)
    meta = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=device,
        gpu=gpu,
        profile=profile,
        versions=versions(),
        command="python scripts/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        wall_s=time.time() - start,
        host=platform.node(),
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (args.out_dir / "results.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    return 0


def _spawn(case: dict[str, Any], steps: int, timeout: float) -> dict[str, Any]:
    """Run one case in a fresh process (its own CUDA context and peak); a timeout or crash is recorded, not raised."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "unused",
        "--steps",
        str(steps),
        "--case-json",
        json.dumps(case),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(status="timeout", reason=f"over {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    status = "oom" if "OutOfMemoryError" in (proc.stderr or "") else "error"
    return dict(status=status, reason=tail[0][:200])


if __name__ == "__main__":
    sys.exit(main())
