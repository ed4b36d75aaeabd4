"""serve.sh: the exact `vllm serve` commands for what export wrote.

Variants (each a `case` branch of serve.sh, one command each):

- merged: the merged weights in `export/merged` (bf16), tensor parallel over the
  fewest GPUs of the hardware profile that hold them;
- lora:   the base model with the adapter on top (vLLM multi-LoRA: `--enable-lora
  --lora-modules NAME=PATH --max-lora-rank R`); the adapter answers under the
  run's name, the base under NAME-base;
- fp8:    the merged weights quantized to FP8 when vLLM loads them (`--quantization
  fp8`): half the memory, so a merged 70B (141 GB in bf16) fits one H200.

A model whose forward ends in a score head (a reward model) is served by vLLM's pooling
runner (`--runner pooling --convert classify`: one value a sequence through `/classify` and
`/pooling`, no text generation), and merged only: its head is trained in full beside the
adapter (PEFT's modules_to_save), which vLLM's LoRA loading does not take.

Paths are relative to the export folder (serve.sh changes into it), so the folder
can be copied to the serving machine as is. vLLM is not needed to write them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.modeling.outputs import Identity
from finetune.planner import Plan

# Why an adapter on a mixture of experts' fused experts is served merged (one line in serve.sh): vLLM's MoE LoRA
# (FusedMoEWithLoRA, vllm-project/vllm#21229) was not run here, and users report that adapters trained on fused
# 3-D experts do not load (vllm-project/vllm#33259, #40005).
EXPERT_ADAPTER_NOTE = (
    "LoRA on the fused experts (PEFT's target_parameters) is served merged only: whether vLLM's MoE LoRA "
    "(vllm-project/vllm#21229) loads PEFT's fused 3-D adapter layout was not checked, and users report it "
    "does not (#33259)"
)
# vLLM's arguments for each head the trained model's forward can end in (finetune/core/objectives.py HEADS): an LM
# head generates text (vLLM's default runner); a score head (AutoModelForSequenceClassification) is a pooling model.
HEAD_RUNNER: dict[str, tuple[str, ...]] = {
    "lm": (),
    "score": ("--runner", "pooling", "--convert", "classify"),
}
POOLING_NOTE = (
    "A score head (a reward model): vLLM's pooling runner, one value a sequence; POST the text to /classify "
    "(or /pooling), no /v1/completions."
)
# Heads whose adapter vLLM can serve on the base (a score head is trained whole beside the adapter: merged only).
ADAPTER_SERVED_HEADS = ("lm",)
# vLLM's accepted --max-lora-rank values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Share of vLLM's GPU budget the weights may take; the rest is left for the KV cache and activations.
WEIGHT_SHARE = 0.8


@dataclass(frozen=True)
class ServeCommand:
    variant: str  # merged | lora | fp8
    argv: tuple[str, ...]
    note: str

    @property
    def line(self) -> str:
        return shlex.join(self.argv)


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(
        f"method.lora_rank={rank} exceeds vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})"
    )


def weights_gb(cfg: Config, plan: Plan, fp8: bool = False) -> float:
    """Weights in GB as vLLM holds them: bf16, or FP8 linears with the embeddings and head kept in bf16."""
    total = plan.params_total
    if not fp8:
        return 2.0 * total / 1e9
    m = cfg.model
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
    return ((total - embeddings) * 1.0 + embeddings * 2.0) / 1e9


def tensor_parallel(cfg: Config, weights: float) -> tuple[int, bool]:
    """(GPUs, fits): the fewest GPUs of the profile (a power of two dividing the heads) that hold `weights`."""
    hw, x = cfg.hardware, cfg.export
    per_gpu = (hw.gpu_memory_gb or 0.0) * x.gpu_memory_utilization * WEIGHT_SHARE
    options = [tp for tp in (1, 2, 4, 8, 16) if tp <= hw.gpus_per_node and cfg.model.num_heads % tp == 0]
    for tp in options:
        if per_gpu and weights / tp <= per_gpu:
            return tp, True
    return options[-1], False


def _common(cfg: Config, plan: Plan, tp: int) -> list[str]:
    x = cfg.export
    return [
        *HEAD_RUNNER[cfg.objective.spec.head],
        "--dtype", x.serve_dtype,
        "--max-model-len", str(x.max_model_len or plan.seq_len),
        "--tensor-parallel-size", str(tp),
        "--gpu-memory-utilization", f"{x.gpu_memory_utilization:g}",
        "--port", str(x.port),
    ]  # fmt: skip


def _fit_note(cfg: Config, what: str, weights: float, tp: int, fits: bool) -> str:
    hw = cfg.hardware
    if hw.device != "cuda":
        return (
            f"{what}: {weights:.3g} GB of weights; hardware={hw.name} is no GPU profile, so tensor parallel "
            f"{tp} (set export.tensor_parallel_size for the serving machine)"
        )
    where = f"{hw.name} ({hw.gpu_memory_gb:g} GB per GPU)" if hw.gpu_memory_gb else hw.name
    if fits:
        return f"{what}: {weights:.3g} GB of weights on {tp} GPU(s) of {where}"
    return (
        f"{what}: {weights:.3g} GB of weights do not fit {where} with room for the KV cache at "
        f"tensor parallel {tp}; use the fp8 variant or a larger profile"
    )


def serve_commands(
    cfg: Config,
    plan: Plan,
    *,
    merged: bool,
    adapter: bool,
    base_source: Optional[str] = None,
    merged_4bit: bool = False,
) -> list[ServeCommand]:
    """The vLLM commands for what export wrote (`merged/`, `adapter/`), with their memory notes.

    `merged_4bit`: the merged weights are bitsandbytes NF4 (export.allow_lossy_4bit_merge), served as such.
    """
    x = cfg.export
    name = x.served_model_name or cfg.name
    commands = []
    if merged:
        bf16 = weights_gb(cfg, plan)
        tp, fits = tensor_parallel(cfg, bf16)
        tp = x.tensor_parallel_size or tp
        argv = [
            "vllm",
            "serve",
            f"./{rundir.MERGED_DIR}",
            "--served-model-name",
            name,
            *_common(cfg, plan, tp),
        ]
        note = _fit_note(cfg, "merged bf16", bf16, tp, fits)
        if merged_4bit:
            argv[5:5] = ["--quantization", "bitsandbytes"]
            note = (
                "merged into the NF4 base (lossy, export.allow_lossy_4bit_merge): bitsandbytes 4-bit weights"
            )
        commands.append(ServeCommand("merged", tuple(argv), note))
    # an adapter on the fused experts: the merged model only, where there is one (EXPERT_ADAPTER_NOTE)
    served_adapter = cfg.objective.spec.head in ADAPTER_SERVED_HEADS
    if adapter and base_source and served_adapter and not (cfg.method.lora_experts and merged):
        bf16 = weights_gb(cfg, plan)
        tp, fits = tensor_parallel(cfg, bf16)
        tp = x.tensor_parallel_size or tp
        argv = [
            "vllm", "serve", base_source, "--served-model-name", f"{name}-base",
            "--enable-lora", "--lora-modules", f"{name}=./{rundir.EXPORT_ADAPTER_DIR}",
            "--max-lora-rank", str(max_lora_rank(cfg.method.lora_rank)), "--max-loras", "1",
            *_common(cfg, plan, tp),
        ]  # fmt: skip
        note = _fit_note(cfg, "base bf16 + adapter", bf16, tp, fits)
        if cfg.method.spec.quantized_base:
            note += "; the adapter was trained on the NF4 base, served here on the bf16 one (as merged)"
        if cfg.method.lora_experts:
            note += f"; {EXPERT_ADAPTER_NOTE}"
        commands.append(ServeCommand("lora", tuple(argv), note))
    if merged and x.fp8 and not merged_4bit:
        fp8 = weights_gb(cfg, plan, fp8=True)
        tp, fits = tensor_parallel(cfg, fp8)
        tp = x.tensor_parallel_size or tp
        argv = [
            "vllm", "serve", f"./{rundir.MERGED_DIR}", "--served-model-name", name, "--quantization", "fp8",
            *_common(cfg, plan, tp),
        ]  # fmt: skip
        commands.append(ServeCommand("fp8", tuple(argv), _fit_note(cfg, "merged fp8", fp8, tp, fits)))
    return commands


def script(cfg: Config, commands: list[ServeCommand], made_from: Optional[Identity] = None) -> str:
    """serve.sh's text; `made_from` (the trained output the export was made from) is named in its header."""
    variants = [c.variant for c in commands]
    lines = [
        "#!/usr/bin/env bash",
        # Names come from configs and a model's config.json: shell_comment keeps each on its comment line.
        rundir.shell_comment(
            f"Serve run '{cfg.name}' ({cfg.method.name} on {cfg.model.name}) with vLLM. Written by mode=export."
        ),
    ]
    if made_from is not None:
        lines.append(
            rundir.shell_comment(f"Serves what mode=export made from the trained {made_from.describe()}.")
        )
    lines += [
        f"#   bash serve.sh [{'|'.join(variants)}]     (default: {variants[0]})",
        "#   merged: the merged bf16 weights in ./merged",
        "#   lora:   the base model with ./adapter on top (clients ask for the run's name; NAME-base is the base)",
        "#   fp8:    ./merged quantized to FP8 at load: half the weight memory (a merged 70B fits one H200)",
        *([rundir.shell_comment(EXPERT_ADAPTER_NOTE + ".")] if cfg.method.lora_experts else []),
        *([rundir.shell_comment(POOLING_NOTE)] if HEAD_RUNNER[cfg.objective.spec.head] else []),
        "# Paths are relative to this folder: copy the folder, run the script from anywhere.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        f'case "${{1:-{variants[0]}}}" in',
    ]
    for c in commands:
        lines += [f"  {c.variant})", f"    {rundir.shell_comment(c.note)}", f"    exec {c.line}", "    ;;"]
    lines += [
        "  *)",
        f'    echo "usage: $0 [{"|".join(variants)}]" >&2',
        "    exit 2",
        "    ;;",
        "esac",
        "",
    ]
    return "\n".join(lines)


def write(
    cfg: Config, path: Path, commands: list[ServeCommand], made_from: Optional[Identity] = None
) -> None:
    # the mode is set on the temporary file before the rename: a chmod after it would follow a planted link
    rundir.atomic_write_text(path, script(cfg, commands, made_from), mode=0o755)
