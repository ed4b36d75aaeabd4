"""mode=export: merge and save what ships, prove the merge, write serve.sh, evaluate the merged model.

    python -m finetune +recipe=tiny mode=export      # after mode=train (and mode=eval)

Writes RUN_DIR/export/:
- merged/           safetensors shards, tokenizer, generation config (adapters merged, or the full model)
- adapter/          the adapter alone (LoRA, QLoRA), with its size in export.json
- merge_check.json  {ok, max_abs_diff, tolerance, mean_abs_diff, top1_agreement, tokens, base, dtype, ...}
- serve.sh          `vllm serve` for the merged model, the base + adapter, and FP8; names the model it serves
- export.json       what was written, sizes, the serve commands as argument lists, `made_from`
- made_from.json    the identity of the trained output it was made from (`finetune.modeling.outputs`)
- gguf/             export.gguf: NAME.TYPE.gguf (llama.cpp's converter) and an Ollama Modelfile
- README.md         the Hub model card (`finetune.export.modelcard`)
and then adds `merged` to RUN_DIR/eval/metrics.json (export.evaluate_merged) and uploads export/ to the Hub
(export.push_to_hub; checked to be reachable before anything is written).

Everything is written into RUN_DIR/.export.tmp and renamed into place whole once the merged model, its
check and serve.sh are all written: a failed check, a full disk or a signal leaves the previous export
as it was (and the temporary folder removed).
"""

from __future__ import annotations

import gc
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.config import Config
from finetune.core.errors import LaunchError
from finetune.core.markup import console_text
from finetune.data.stage import load_prepared
from finetune.evaluation import regression
from finetune.evaluation import stage as eval_stage
from finetune.export import gguf, hub, merge, modelcard, serve
from finetune.modeling import outputs
from finetune.modeling.models import load_tokenizer, model_source
from finetune.modeling.variants import trained_dir
from finetune.planner import Plan
from finetune.rundir.layout import EXPORT_GGUF_DIR, MODEL_CARD_FILE, MODELFILE

log = logging.getLogger(__name__)


def copy_adapter(cfg: Config, run_dir: Path, out: Path) -> dict[str, Any]:
    src = trained_dir(cfg, run_dir)
    if not (src / "adapter_config.json").is_file():
        raise LaunchError(f"{src}: no adapter; run the training stage (mode=train) first")
    outputs.check_adapter(src)  # whole, as recorded, readable and finite before it ships
    shutil.copytree(src, out)  # with its identity.json: the adapter says what it is wherever it is copied
    weights = sum(p.stat().st_size for p in out.glob("adapter_model*.safetensors"))
    return {
        "path": str(out),
        "size_bytes": merge.dir_size(out),
        "weights_bytes": weights,
        "rank": cfg.method.lora_rank,
        "alpha": cfg.method.lora_alpha,
        "target_modules": cfg.method.targets(cfg.model.architecture),
    }


def run(cfg: Config, run_dir: Path, plan: Plan, *, eval_dataset: Any = None) -> dict[str, Any]:
    """Export per `cfg.export`; returns export.json's content. `eval_dataset` replaces the data stage's (tests)."""
    run_dir = Path(run_dir)
    x = cfg.export
    merges = x.merge or not cfg.method.uses_adapters
    if not merges and cfg.objective.spec.head not in serve.ADAPTER_SERVED_HEADS:
        raise merge.ExportError(
            f"export.merge=false: objective={cfg.objective.name} trains a {cfg.objective.spec.head} head whole "
            "beside the adapter, which vLLM serves merged only; set export.merge=true (the adapter is exported "
            "beside the merged model)"
        )
    hub.check_reachable(cfg)  # before anything is read, merged or written: nothing is half-uploaded
    source = trained_dir(cfg, run_dir)
    identity = outputs.identity_of(source)
    if identity is None:
        raise LaunchError(f"{source}: no trained output; run the training stage (mode=train) first")
    if eval_dataset is None:
        try:
            eval_dataset = load_prepared(run_dir)[1]
        except Exception as exc:  # no data stage: the check falls back to the regression prompts
            log.warning("no held-out split for the merge check (%s); using the regression prompts", exc)
    do_merge = x.merge or not cfg.method.uses_adapters
    # The converter (fetched once) and the quantizer, before anything is merged or written.
    converter = gguf.check_ready(cfg, do_merge)
    out = rundir.export_dir(run_dir)
    with outputs.staged(out, _export_bytes(cfg, plan, source)) as staging:
        summary = _write_export(cfg, run_dir, plan, staging, identity, eval_dataset, converter)
    _print_summary(summary, out)
    if do_merge and x.evaluate_merged:
        summary["eval"] = eval_stage.run(cfg, run_dir, ["merged"], eval_dataset=eval_dataset)
        # the card's evaluation table with the merged model's scores
        card = modelcard.render(cfg, run_dir, summary, modelcard.base_license(cfg.model))
        rundir.atomic_write_text(out / MODEL_CARD_FILE, card)
    if x.push_to_hub:
        summary["hub"] = hub.upload(cfg, out)
    return summary


def _export_bytes(cfg: Config, plan: Plan, source: Path) -> int:
    """About what export/ takes: the merged weights in the merge dtype (fp32 on the CPU, where the plan's
    bf16 estimate is half of it) and the adapter's copy."""
    merged = cfg.export.merge or not cfg.method.uses_adapters
    weights = plan.params_total * (4 if merge.merge_dtype(cfg) == "fp32" else 2) if merged else 0
    return weights + (merge.dir_size(source) if cfg.method.uses_adapters else 0)


def _write_export(
    cfg: Config,
    run_dir: Path,
    plan: Plan,
    out: Path,
    identity: outputs.Identity,
    eval_dataset: Any,
    converter: Optional[Path],
) -> dict[str, Any]:
    """Everything export/ holds, written into `out` (the staging folder); export.json's content."""
    x = cfg.export
    tokenizer = load_tokenizer(cfg.model)
    summary: dict[str, Any] = {
        "method": cfg.method.name,
        "model": cfg.model.name,
        "made_from": identity.to_dict(),
    }

    if cfg.method.uses_adapters:
        summary["adapter"] = copy_adapter(cfg, run_dir, out / rundir.EXPORT_ADAPTER_DIR)
    do_merge = x.merge or not cfg.method.uses_adapters
    if do_merge:
        if cfg.method.uses_adapters and x.check_host_memory:
            summary["host_memory_gb"] = {
                "needed": plan.merge_host_memory_gb,
                "available": round(merge.check_host_memory(plan.merge_host_memory_gb), 2),
            }
        fallback = [r["messages"] for r in regression.load(None)]
        inputs = merge.check_inputs(eval_dataset, tokenizer, x.check_samples, x.check_max_tokens, fallback)
        model, check = merge.merged_model(cfg, run_dir, inputs)
        lossy = check["dtype"] == "nf4"
        tolerance = x.tolerance_for("bf16" if lossy else check["dtype"])
        check = {"ok": check["max_abs_diff"] <= tolerance, "max_abs_diff": check["max_abs_diff"],
                 "tolerance": tolerance, "lossy": lossy, **{k: v for k, v in check.items() if k != "max_abs_diff"}}  # fmt: skip
        summary["merge_check"] = check
        if not check["ok"] and lossy:
            log.warning(
                "lossy 4-bit merge: max |logit diff| %.3g exceeds %g; shipped anyway (export.allow_lossy_4bit_merge)",
                check["max_abs_diff"],
                tolerance,
            )
        elif not check["ok"]:
            raise merge.ExportError(
                f"merge check failed: max |logits(merged) - logits(adapter)| = {check['max_abs_diff']:.3g} "
                f"> export.tolerance={tolerance:g} (mean {check['mean_abs_diff']:.3g}, top-1 agreement "
                f"{check['top1_agreement']:.4f} over {check['tokens']} tokens); nothing was exported, "
                f"{rundir.EXPORT_DIR}/ is as it was"
            )
        summary["merged"] = merge.save_model(model, tokenizer, out / rundir.MERGED_DIR, x.max_shard_size)
        del model
        gc.collect()
        # After the merged model it checks, in the same staging folder: both go into place together.
        rundir.write_json(out / rundir.MERGE_CHECK_FILE, check)
        if converter is not None:
            folder = out / EXPORT_GGUF_DIR
            summary["gguf"] = gguf.convert(cfg, converter, out / rundir.MERGED_DIR, folder)
            modelfile = gguf.modelfile(tokenizer, summary["gguf"]["path"])
            rundir.atomic_write_text(folder / MODELFILE, modelfile)

    commands = serve.serve_commands(
        cfg,
        plan,
        merged=do_merge,
        adapter=cfg.method.spec.serve_adapter,
        base_source=model_source(cfg.model) if cfg.method.spec.serve_adapter else None,
        merged_4bit=bool(summary.get("merge_check", {}).get("lossy")),
    )
    serve.write(cfg, out / rundir.SERVE_FILE, commands, identity)
    summary["serve"] = {c.variant: {"argv": list(c.argv), "note": c.note} for c in commands}
    final = rundir.export_dir(run_dir)  # export.json names where things will be, not the staging folder
    for part in ("adapter", "merged"):
        if part in summary:
            summary[part]["path"] = str(final / Path(summary[part]["path"]).name)
    rundir.write_json(out / rundir.EXPORT_SUMMARY_FILE, summary)
    card = modelcard.render(cfg, run_dir, summary, modelcard.base_license(cfg.model))
    rundir.atomic_write_text(out / MODEL_CARD_FILE, card)
    outputs.write_made_from(out, identity)
    return summary


def _print_summary(summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    made_from = outputs.Identity.from_dict(summary["made_from"])
    if made_from is not None:
        console.print(f"exported: {made_from.describe()}", highlight=False)
    check = summary.get("merge_check")
    if check:
        console.print(
            f"merge check: max |Δlogit| {check['max_abs_diff']:.3g} (tolerance {check['tolerance']:g}), "
            f"top-1 agreement {check['top1_agreement']:.4f} over {check['tokens']} tokens: "
            + ("[green]ok[/green]" if check["ok"] else "[red]FAILED[/red]")
        )
    if "merged" in summary:
        console.print(
            f"merged: {summary['merged']['size_bytes'] / 1e6:,.1f} MB in {len(summary['merged']['shards'])} shard(s)"
        )
    if "adapter" in summary:
        console.print(f"adapter: {summary['adapter']['size_bytes'] / 1e6:,.2f} MB")
    if "gguf" in summary:
        gguf_file = out / EXPORT_GGUF_DIR / summary["gguf"]["path"]
        console.print(
            f"gguf: {console_text(str(gguf_file))} ({summary['gguf']['size_bytes'] / 1e6:,.1f} MB); Ollama: "
            + console_text(rundir.command_line("ollama", "create", summary["gguf"]["path"].rsplit(".", 2)[0], "-f",
                                               out / EXPORT_GGUF_DIR / MODELFILE))
        )  # fmt: skip
    serve_line = rundir.command_line("bash", out / rundir.SERVE_FILE)
    console.print(f"serve: {console_text(serve_line)} {console_text('[' + '|'.join(summary['serve']) + ']')}")
