"""The plan as a readable table on the terminal (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from finetune.core.markup import console_text
from finetune.planner import Plan
from finetune.planner.advice import shortlist


def _gb(value: float) -> str:
    return f"{value:,.2f}"


def print_plan(plan: Plan, title: str, console: Console | None = None) -> None:
    """The plan on the console; names, paths and reasons hold user text, escaped (`markup.console_text`)."""
    console = console or Console()
    hw, s, m = plan.hardware, plan.strategy, plan.gpu_memory
    on_gpus = hw.device == "cuda"
    verdict = "[bold green]FITS[/]" if plan.fits else "[bold red]DOES NOT FIT[/]"
    gpus = f"{hw.total_gpus} x " if hw.total_gpus > 1 else ""
    # What was detected on this machine (hardware=local): the names nvidia-smi gives.
    kind = f"{console_text(' / '.join(hw.gpu_names))}, " if hw.name == "local" and hw.gpu_names else ""
    # On the CPU the host's RAM is the memory the job must fit in: no GPU is spoken of.
    size = f"{gpus}{kind}{hw.gpu_memory_gb:g} GB" if on_gpus else f"{hw.gpu_memory_gb:g} GB RAM"
    per = " per GPU" if on_gpus else " RAM"
    # what does not fit beside the training side's terms (a generating objective's rollout): its reason's head
    beside = (
        f" ({plan.reasons[0].split(':')[0]})"
        if not plan.fits and plan.reasons and m.total <= plan.usable_gpu_memory_gb
        else ""
    )
    console.print(
        f"\n[bold]{console_text(title)}[/] on [bold]{console_text(hw.name)}[/] ({size}): {verdict}"
        f"  - {m.total:,.1f} GB of {plan.usable_gpu_memory_gb:,.1f} GB usable{per}{console_text(beside)}"
    )
    # a mixture of experts: the parameters a token runs through, what MoE models are compared by
    active = f", {plan.params_active:,} active" if plan.params_active != plan.params_total else ""
    console.print(
        f"params: {plan.params_total:,} total{active}, {plan.params_trainable:,} trainable"
        f" ({100 * plan.params_trainable / plan.params_total:.2f}%), seq_len {plan.seq_len:,}"
    )

    terms = Table(title="GPU memory per GPU (GB)" if on_gpus else "memory (GB of RAM)", show_footer=True)
    terms.add_column("term", footer="total")
    terms.add_column("GB", justify="right", footer=_gb(m.total))
    for name, gb in m.terms():
        terms.add_row(console_text(name), _gb(gb))
    strategy = Table(title="strategy")
    strategy.add_column("setting")
    strategy.add_column("value")
    strategy.add_row("sharding", s.sharding)
    strategy.add_row("optimizer", s.optimizer)
    strategy.add_row("offload optimizer / params", f"{s.offload_optimizer} / {s.offload_params}")
    strategy.add_row("activation checkpointing", str(s.activation_checkpointing))
    if s.activation_offloading:
        strategy.add_row("activation offloading", "True (layer inputs in host RAM)")
    split = s.split
    strategy.add_row(
        "sequence split",
        "none" if split is None else f"{split.key} over {s.sequence_parallel} GPUs ({split.label})",
    )
    strategy.add_row("attention", s.attention)
    strategy.add_row("chunked loss", str(s.chunked_loss))
    strategy.add_row("micro-batch x accumulation", f"{s.micro_batch_size} x {s.grad_accum_steps}")
    console.print(terms, strategy)

    e = plan.estimate
    host = f"host RAM {plan.host_memory_gb:,.0f} GB per node"
    if hw.host_memory_gb is not None:
        host += f" of {hw.host_memory_gb:,.0f}"
    free = "" if hw.disk_free_gb is None else f" ({hw.disk_free_gb:,.0f} GB free)"
    console.print(
        f"{host}; disk: checkpoint {plan.disk_checkpoint_gb:,.2f} GB, export {plan.disk_export_gb:,.2f} GB{free}"
    )
    if e.tokens_per_second is not None:
        line = f"estimate: {e.tokens_per_second:,.0f} tokens/s, {e.step_seconds:,.2f} s/step"
        if e.run_hours is not None:
            line += f", {e.run_hours:,.2f} h"
        if e.usd is not None:
            line += f", {e.usd:,.0f} USD"
        console.print(line)
    for title_, items in (("why", plan.reasons), ("what would fit", plan.suggestions)):
        if items:
            console.print(f"[bold]{title_}:[/]")
            for item in items:
                console.print(f"  - {console_text(item)}")
    _print_alternatives(plan, console)


def _figure(value: float | None, digits: int = 0) -> str:
    """A price or a duration; one too small for its digits says so rather than print as zero."""
    if value is None:
        return "-"
    floor = 10.0**-digits
    return f"<{floor:g}" if 0 < value < floor else f"{value:,.{digits}f}"


def _print_alternatives(plan: Plan, console: Console) -> None:
    """The best few other profiles (every one that fits with a cheaper or faster trade; plan.json has all):
    usable memory, how each runs where that differs, its price per GPU-hour and month, and the run's
    hours and cost when its length is known."""
    shown = shortlist(plan)
    if not shown:
        return
    run_known = any(a.run_hours is not None for a in shown)
    fitting = any(a.fits for a in shown)
    title = "alternatives" if fitting else "alternatives (none fits: the nearest)"
    alts = Table(title=title)
    columns = ["hardware", "fits", "GB/GPU", "usable", "USD/GPU-h", "USD/month"]
    if run_known:
        columns += ["run h", "run USD"]
    columns.append("strategy there")
    for col in columns:
        alts.add_column(col, justify="left" if col in ("hardware", "fits", "strategy there") else "right")
    for a in shown:
        row = [
            console_text(a.hardware),
            "yes" if a.fits else "no",
            f"{a.total_gb:,.2f}",
            _figure(a.usable_gb, 1),
            _figure(a.usd_per_gpu_hour, 2),
            _figure(a.usd_per_month),
        ]
        if run_known:
            row += [_figure(a.run_hours, 2), _figure(a.run_usd, 2)]
        alts.add_row(*row, "as planned" if a.strategy is None else console_text(a.strategy))
    console.print(alts)
    others = len([a for a in plan.alternatives if a.hardware != plan.hardware.name])
    if others > len(shown):
        console.print(
            f"{others - len(shown)} more profiles weighed (slower and no cheaper, or not fitting): "
            "plan.json's alternatives"
        )
