"""The pages as HTML strings: plain HTML and inline SVG, styled and scripted by the package's static files.

Every value that came from a user, a config, a model or a run directory goes through `esc` (HTML-escaped,
quotes too), so a model name or a sample answer holding `<script>` shows as that text. The numbers are
plan.json's own (GB as it rounds them), so what the page shows is what the command line writes.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any, Optional

from finetune.planner import Memory, Plan
from finetune.ui.calculator import PASTED, PlanForm, Planned, choices
from finetune.ui.runs import RunView

# plan.json's memory terms (the contract's `Memory` fields), bottom of the stack first, with their colours.
TERMS = tuple(
    zip(
        (f.name for f in fields(Memory)),
        ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#9c9c9c", "#76b7b2", "#edc948"),
    )
)
# The companion models' terms (`companion:ROLE`: a teacher's, a reward model's weights and forward), stacked on top.
COMPANION_COLOURS = ("#e15759", "#edc948", "#ff9da7", "#9d7660")


def memory_terms(memory: Memory) -> list[tuple[str, float, str]]:
    """(name, GB, colour) of every term a plan holds, as plan.json names them: the six of every plan, then one
    per companion model."""
    colours = dict(TERMS)
    companions = iter(COMPANION_COLOURS * len(memory.companions))
    return [(name, value, colours.get(name) or next(companions)) for name, value in memory.terms()]


def esc(value: Any) -> str:
    return html.escape("-" if value is None else str(value), quote=True)


def gb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.3f}"


def money(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.2f}"


def page(title: str, body: str, active: str) -> str:
    nav = "".join(
        f'<a href="{href}"{" class=active" if name == active else ""}>{name}</a>'
        for name, href in (("plan", "/"), ("runs", "/runs"))
    )
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} - finetune</title>"
        '<link rel=stylesheet href="/static/ui.css"><script src="/static/ui.js" defer></script></head>'
        f"<body><header><strong>finetune</strong><nav>{nav}</nav></header><main>{body}</main></body></html>\n"
    )


def error_block(message: str) -> str:
    return f"<p id=error class=error role=alert>{esc(message)}</p>"


# ---------------------------------------------------------------- the plan page


def _select(name: str, label: str, value: str, default_label: str) -> str:
    options = [f'<option value=""{" selected" if not value else ""}>{esc(default_label)}</option>']
    for option in choices(name):
        shown = "pasted config.json (below)" if option == PASTED else option
        options.append(
            f'<option value="{esc(option)}"{" selected" if option == value else ""}>{esc(shown)}</option>'
        )
    if value and value not in choices(name):  # shown as given, so the error above it names what was chosen
        options.append(f'<option value="{esc(value)}" selected>{esc(value)}</option>')
    return f"<label>{label}<select name={name} id=f-{name}>{''.join(options)}</select></label>"


def _number(name: str, label: str, value: str, hint: str) -> str:
    return (
        f'<label>{label}<input name={name} id=f-{name} value="{esc(value)}" inputmode=numeric '
        f'placeholder="{esc(hint)}" autocomplete=off></label>'
    )


def plan_form(form: PlanForm) -> str:
    kept = "the recipe's" if form.recipe else "the default"
    hidden = "" if form.model == PASTED else " hidden"
    controls = [
        _select("recipe", "recipe", form.recipe, "none (the defaults)"),
        _select("model", "model", form.model, kept),
        f'<label>or a hub id<input name=hub_id id=f-hub_id value="{esc(form.hub_id)}" '
        'placeholder="ORG/NAME" autocomplete=off spellcheck=false></label>',
        f"<label id=config-label{hidden}>config.json (pasted; never executed)"
        f"<textarea name=config id=f-config rows=6 spellcheck=false>{esc(form.config)}</textarea></label>",
        _select("method", "method", form.method, kept),
        _select("objective", "objective", form.objective, kept),
        _number("seq_len", "sequence length", form.seq_len, kept),
        _number("micro_batch", "micro-batch", form.micro_batch, "the planner's choice"),
        _select("hardware", "hardware", form.hardware, kept),
        _number("dataset_tokens", "dataset tokens (run length)", form.dataset_tokens, "for the run's cost"),
    ]
    return (
        f'<form id=plan-form method=get action="/">{"".join(controls)}'
        "<button type=submit id=submit>plan</button></form>"
    )


def memory_bars(plan: Plan, peak: Optional[float] = None) -> str:
    """The per-GPU terms stacked against the usable memory (dashed) and the GPU's memory (solid); a run's
    measured peak as a second bar under them."""
    m, usable = plan.gpu_memory, plan.usable_gpu_memory_gb
    card = plan.hardware.gpu_memory_gb or usable
    width, top, height = 800.0, 22.0, 36.0
    scale = width / (max(m.total, card, peak or 0.0) * 1.04 or 1.0)
    parts, x = [], 0.0
    for term, value, colour in memory_terms(m):
        w = value * scale
        parts.append(
            f'<rect class=term data-term="{esc(term)}" x="{x:.2f}" y="{top}" width="{w:.2f}" height="{height}" '
            f'fill="{colour}"><title>{esc(term)}: {gb(value)} GB</title></rect>'
        )
        x += w
    bottom = top + height + 8
    if peak is not None:
        bottom = top + height + 46
        parts.append(
            f'<rect data-term=peak x="0" y="{top + height + 26}" width="{peak * scale:.2f}" height="16" '
            f'fill="#263238"><title>measured peak: {gb(peak)} GB</title></rect>'
            f'<text x="{peak * scale + 6:.2f}" y="{top + height + 38}" font-size="11">measured peak</text>'
        )
    # the usable line is labelled under the bar, the GPU's memory above it, so close values do not overlap
    for value, label, dash, label_y in (
        (usable, "usable", "6 4", top + height + 20),
        (card, "GPU", "", 11.0),
    ):
        lx = value * scale
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(
            f'<line x1="{lx:.2f}" x2="{lx:.2f}" y1="14" y2="{bottom}" stroke="#c0392b" stroke-width="2"{dashes}/>'
            f'<text x="{lx:.2f}" y="{label_y}" text-anchor="middle" font-size="11">{label} {value:,.1f} GB</text>'
        )
    return (
        f'<svg id=bars role=img viewBox="0 -4 {width + 60:.0f} {bottom + 14:.0f}" width="100%" '
        f'aria-label="memory per GPU against the usable memory">{"".join(parts)}</svg>'
    )


def _terms_table(plan: Plan) -> str:
    rows = "".join(
        f'<tr data-term="{esc(term)}"><td><svg class=swatch width="10" height="10" aria-hidden="true"><rect width="10" height="10" fill="{colour}"/></svg> {esc(term)}</td>'
        f"<td class=num>{gb(value)}</td></tr>"
        for term, value, colour in memory_terms(plan.gpu_memory)
    )
    return (
        "<table id=terms><thead><tr><th>term</th><th>GB per GPU</th></tr></thead>"
        f"<tbody>{rows}</tbody><tfoot><tr data-term=total><td>total</td>"
        f"<td class=num>{gb(plan.gpu_memory.total)}</td></tr>"
        f"<tr data-term=usable><td>usable (after the headroom)</td><td class=num>{gb(plan.usable_gpu_memory_gb)}"
        "</td></tr></tfoot></table>"
    )


def _strategy_table(payload: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr data-key={esc(k)}><td>{esc(k)}</td><td>{esc(v)}</td></tr>"
        for k, v in payload["strategy"].items()
    )
    layout = payload["layout"]
    rows += (
        f"<tr data-key=layout><td>layout</td><td>{esc(layout['nodes'])} node(s) x "
        f"{esc(layout['processes_per_node'])} process(es), {esc(layout['engine'])}</td></tr>"
    )
    return (
        f"<table id=strategy><thead><tr><th>strategy</th><th></th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _items(ident: str, title: str, items: Iterable[str]) -> str:
    lis = "".join(f"<li>{esc(i)}</li>" for i in items)
    return f"<h3>{title}</h3><ul id={ident}>{lis}</ul>" if lis else ""


def _alternatives(planned: Planned) -> str:
    rows = "".join(
        f'<tr data-hardware="{esc(a.hardware)}"{" class=chosen" if a.hardware == planned.plan.hardware.name else ""}>'
        f"<td>{esc(a.hardware)}</td><td>{'yes' if a.fits else 'no'}</td><td class=num>{gb(a.total_gb)}</td>"
        f"<td class=num>{money(a.usd_per_hour)}</td>"
        f"<td class=num>{'-' if a.run_hours is None else f'{a.run_hours:,.2f}'}</td>"
        f"<td class=num>{money(a.run_usd)}</td></tr>"
        for a in planned.alternatives
    )
    if not rows:
        return ""
    return (
        "<h3>alternatives</h3><table id=alternatives><thead><tr><th>hardware</th><th>fits</th>"
        "<th>GB per GPU</th><th>USD/hour</th><th>run hours</th><th>USD for the run</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
        "<p class=note>USD/hour: the profile's usd_per_month x nodes / 730. The run: the same job planned "
        "on that hardware, when its length is known (dataset tokens, or the recipe's max_steps).</p>"
    )


def _estimate(payload: Mapping[str, Any]) -> str:
    e = payload["estimate"]
    parts = []
    if e["tokens_per_second"] is not None:
        parts.append(f"<span data-key=tokens_per_second>{e['tokens_per_second']:,.0f}</span> tokens/s")
    if e["step_seconds"] is not None:
        parts.append(f"<span data-key=step_seconds>{e['step_seconds']:,.2f}</span> s/step")
    if e["run_hours"] is not None:
        parts.append(f"<span data-key=run_hours>{e['run_hours']:,.2f}</span> h")
    if e["usd"] is not None:
        parts.append(f"<span data-key=usd>{e['usd']:,.2f}</span> USD")
    return f"<p id=estimate>estimate: {', '.join(parts)}</p>" if parts else ""


def plan_result(planned: Planned) -> str:
    plan, payload = planned.plan, planned.payload
    hw = payload["hardware"]
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    gpus = f"{hw['gpus']} x " if hw["gpus"] > 1 else ""
    params = payload["params"]
    query = planned.form.query()
    return (
        f"<h2 id=verdict data-fits={'true' if plan.fits else 'false'} class={'fits' if plan.fits else 'nofit'}>"
        f"{verdict}</h2>"
        f"<p id=summary><b>{esc(planned.title)}</b> on <b id=hardware>{esc(hw['name'])}</b> "
        f"({gpus}{hw['gpu_memory_gb']:g} GB): <span id=total>{gb(plan.gpu_memory.total)}</span> GB of "
        f"<span id=usable>{gb(plan.usable_gpu_memory_gb)}</span> GB usable per GPU; "
        f"params {params['total']:,} total, <span id=trainable>{params['trainable']:,}</span> trainable; "
        f"seq_len <span id=seq-len>{payload['seq_len']}</span></p>"
        f"{memory_bars(plan)}<div class=cols>{_terms_table(plan)}{_strategy_table(payload)}</div>"
        f"{_estimate(payload)}"
        f"<p id=host>host RAM {payload['host_memory_gb']:,.1f} GB per node; disk: checkpoint "
        f"{payload['disk_gb']['checkpoint']:,.2f} GB, export {payload['disk_gb']['export']:,.2f} GB</p>"
        f"{_items('reasons', 'why', plan.reasons)}{_items('suggestions', 'what would fit', plan.suggestions)}"
        f"{_alternatives(planned)}"
        "<h3>the same plan from the command line</h3>"
        f"<pre id=command>{esc(planned.command)}</pre>"
        + (
            "<p class=note>with the pasted config saved as config.json in the current folder</p>"
            if planned.form.model == PASTED
            else ""
        )
        + f'<p><a id=download href="/plan.json?{esc(query)}" download=plan.json>download plan.json</a> '
        f'<a id=share href="/?{esc(query)}">link to this plan</a></p>'
    )


def plan_page(form: PlanForm, planned: Optional[Planned], error: Optional[str]) -> str:
    result = error_block(error) if error else plan_result(planned) if planned else ""
    body = (
        "<h1>Will it fit?</h1><div class=plan>"
        f"<section id=settings>{plan_form(form)}</section><section id=result>{result}</section></div>"
    )
    return page("plan", body, "plan")


# ---------------------------------------------------------------- the runs pages


def runs_page(views: Sequence[RunView], runs_dir: str) -> str:
    rows = "".join(
        f'<tr data-run="{esc(v.name)}"><td><a href="/runs/{esc(v.name)}">{esc(v.name)}</a></td>'
        f"<td>{esc(v.model)}</td><td>{esc(v.method)}</td><td>{esc(v.hardware)}</td>"
        f"<td class=num>{gb(v.planned_gb)}</td><td class=num>{gb(v.peak_gb)}</td>"
        f"<td class=num>{'-' if v.final_loss is None else f'{v.final_loss:.4f}'}</td></tr>"
        for v in views
    )
    table = (
        "<table id=runs><thead><tr><th>run</th><th>model</th><th>method</th><th>hardware</th>"
        "<th>planned GB</th><th>measured peak GB</th><th>final loss</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
        if rows
        else f"<p id=empty>No run directories under {esc(runs_dir)} yet.</p>"
    )
    return page("runs", f"<h1>Runs under {esc(runs_dir)}</h1>{table}", "runs")


def _plan_vs_peak(view: RunView) -> str:
    if view.plan is None:
        return "<p id=no-plan>No readable plan.json (mode=plan writes it).</p>"
    plan = view.plan
    rows = "".join(
        f'<tr data-term="{esc(term)}"><td>{esc(term)}</td><td class=num>{gb(value)}</td></tr>'
        for term, value, _ in memory_terms(plan.gpu_memory)
    )
    measured = (
        f"<tr data-term=peak><td>measured peak ({esc(view.peak_source or 'training')})</td>"
        f"<td class=num>{gb(view.peak_gb)}</td></tr>"
        if view.peak_gb is not None
        else "<tr data-term=peak><td>measured peak</td><td class=num>- (not trained yet)</td></tr>"
    )
    compared = (
        f"<tr data-term=compared><td>held against the plan</td><td class=num>{gb(view.compared_gb)}</td></tr>"
        if view.compared_gb is not None
        else ""
    )
    return (
        f"{memory_bars(plan, view.peak_gb)}<table id=plan-vs-peak><thead><tr><th>per GPU</th><th>GB</th></tr></thead>"
        f"<tbody>{rows}</tbody><tfoot><tr data-term=total><td>planned total</td>"
        f"<td class=num>{gb(plan.gpu_memory.total)}</td></tr>{measured}{compared}</tfoot></table>"
    )


def loss_curve(series: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    """Training and evaluation loss against the step, as SVG polylines."""
    points = [p for s in series.values() for p in s]
    if not points:
        return "<p id=no-curve>No logged loss yet.</p>"
    width, height, pad = 640.0, 240.0, 40.0
    steps = [s for s, _ in points]
    losses = [v for _, v in points]
    x0, x1 = min(steps), max(steps) if max(steps) > min(steps) else min(steps) + 1
    y0, y1 = min(losses), max(losses) if max(losses) > min(losses) else min(losses) + 1

    def xy(step: int, loss: float) -> str:
        x = pad + (step - x0) / (x1 - x0) * (width - 2 * pad)
        y = height - pad - (loss - y0) / (y1 - y0) * (height - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    colours = {"train": "#4e79a7", "eval": "#e15759"}
    lines = "".join(
        f'<polyline data-series={name} fill="none" stroke="{colours.get(name, "#333")}" stroke-width="2" '
        f'points="{" ".join(xy(s, v) for s, v in data)}"/>'
        + "".join(
            f'<circle cx="{xy(s, v).split(",")[0]}" cy="{xy(s, v).split(",")[1]}" r="2.5" '
            f'fill="{colours.get(name, "#333")}"><title>{name} step {s}: {v:.4f}</title></circle>'
            for s, v in data
        )
        for name, data in series.items()
        if data
    )
    axes = (
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#555"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#555"/>'
        f'<text x="{pad}" y="{height - pad + 16}" font-size="11">step {x0}</text>'
        f'<text x="{width - pad}" y="{height - pad + 16}" font-size="11" text-anchor="end">step {x1}</text>'
        f'<text x="{pad - 4}" y="{pad}" font-size="11" text-anchor="end">{y1:.3g}</text>'
        f'<text x="{pad - 4}" y="{height - pad}" font-size="11" text-anchor="end">{y0:.3g}</text>'
        + "".join(
            f'<text x="{width - pad}" y="{pad - 20 + 14 * i}" font-size="11" text-anchor="end" '
            f'fill="{colours.get(name, "#333")}">{name} loss</text>'
            for i, name in enumerate(n for n, d in series.items() if d)
        )
    )
    return (
        f'<svg id=loss-curve role=img viewBox="0 0 {width:.0f} {height:.0f}" width="100%" '
        f'aria-label="loss against step">{axes}{lines}</svg>'
    )


def _eval_table(view: RunView) -> str:
    if not view.scores:
        return "<p id=no-eval>No evaluation yet (mode=eval writes eval/metrics.json).</p>"
    variants = list(view.scores)
    names: list[str] = []
    for scores in view.scores.values():
        names += [k for k in scores if k not in names]
    head = "".join(f"<th>{esc(v)}</th>" for v in variants)
    rows = "".join(
        f'<tr data-metric="{esc(n)}"><td>{esc(n)}</td>'
        + "".join(
            f'<td class=num data-variant="{esc(v)}">{_metric(view.scores[v].get(n))}</td>' for v in variants
        )
        + "</tr>"
        for n in names
    )
    return (
        f"<p class=note>from {esc(view.scores_source)}</p><table id=evaluation><thead><tr><th>metric</th>{head}"
        f"</tr></thead><tbody>{rows}</tbody></table>"
    )


def _metric(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return esc(value)


def _samples(view: RunView) -> str:
    if not view.samples:
        return "<p id=no-samples>No samples yet (mode=eval writes eval/samples.jsonl).</p>"
    answers = [v for v in ("reference", "base", "trained", "merged") if any(v in s for s in view.samples)]
    head = "".join(f"<th>{v}</th>" for v in ("set", "prompt", *answers))
    rows = "".join(
        "<tr>"
        + "".join(f"<td>{esc(_text(s.get(k)))}</td>" for k in ("set", "prompt"))
        + "".join(f'<td data-variant="{v}">{esc(_text(s.get(v)))}</td>' for v in answers)
        + "</tr>"
        for s in view.samples
    )
    more = (
        f"<p class=note>the first {len(view.samples)} of {view.samples_total}</p>"
        if view.samples_total > len(view.samples)
        else ""
    )
    return f"<table id=samples><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{more}"


def _text(value: Any) -> str:
    """A prompt or answer as text: a message list as `role: content` lines."""
    if isinstance(value, list):
        return "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in value
        )
    return "-" if value is None else str(value)


def run_page(view: RunView) -> str:
    facts = (
        f"<p id=facts>{esc(view.model)} · {esc(view.method)} · {esc(view.hardware)}"
        + (f" · {view.steps} steps" if view.steps is not None else "")
        + (
            f" · final loss <span id=final-loss>{view.final_loss:.4f}</span>"
            if view.final_loss is not None
            else ""
        )
        + "</p>"
    )
    body = (
        f"<h1 id=run-name>{esc(view.name)}</h1>{facts}"
        f"<h2>plan against the measured peak</h2>{_plan_vs_peak(view)}"
        f"<h2>loss</h2>{loss_curve(view.loss)}"
        f"<h2>evaluation</h2>{_eval_table(view)}"
        f"<h2>samples</h2>{_samples(view)}"
    )
    return page(view.name, body, "runs")


def not_found(message: str) -> str:
    return page("not found", f"<h1>Not found</h1>{error_block(message)}", "")
