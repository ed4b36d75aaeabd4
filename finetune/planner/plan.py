"""`make_plan`: the job planned on its hardware (or, for `hardware=auto`, on the cheapest profile that fits),
with the other profiles as alternatives and, when it does not fit, what would."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from finetune.core.config import HardwareConfig, MethodConfig, ModelConfig, PlanConfig, TrainConfig
from finetune.core.errors import PlanError
from finetune.core.objectives import ObjectiveSpec
from finetune.planner import advice
from finetune.planner.calibration import Calibration
from finetune.planner.companions import CompanionShape
from finetune.planner.contract import Plan
from finetune.planner.memory import make_job
from finetune.planner.search import Unrunnable, check_model, plan_on, resolve_seq_len


def make_plan(
    model: ModelConfig,
    method: MethodConfig,
    hardware: HardwareConfig,
    train: TrainConfig,
    plan_cfg: PlanConfig,
    profiles: dict[str, HardwareConfig],
    *,
    seq_len: Optional[int] = None,
    calibration: Optional[Calibration] = None,
    objective: Optional[ObjectiveSpec] = None,
    precompute_reference: Optional[bool] = None,
    kl_reference: bool = False,
    packing: bool = True,
    companions: tuple[CompanionShape, ...] = (),
    installed: Optional[tuple[str, ...]] = None,
) -> Plan:
    """Plan the job. `profiles` are the hardware profiles to weigh as alternatives (and for `auto`).

    `seq_len` overrides `train.seq_len` (the data stage resolves `auto` to the longest kept sequence).
    `objective` (default SFT) says how many sequences an example puts through the model and whether a
    reference model runs; `precompute_reference` fixes full fine-tuning's reference (None: chosen here);
    `kl_reference` says a `when_kl` reference runs (the settings' KL coefficient is above 0);
    `companions` are the frozen models beside the policy, resolved to their shapes; `installed` the optional
    libraries the worker imports where it runs (None: those installed here, `Calibration.installed`).
    """
    check_model(model, method)
    n = resolve_seq_len(model, train, seq_len)
    job = make_job(model, method, hardware, train, n, calibration, plan_cfg, objective, packing)
    if installed is None:
        installed = job.cal.installed(hardware.device)
    job = replace(
        job,
        precompute_reference=precompute_reference,
        kl_reference=kl_reference,
        companions=companions,
        installed=installed,
    )
    gpu_profiles = [p for p in profiles.values() if p.device == "cuda" and p.gpu_memory_gb is not None]
    notes: list[str] = []
    if hardware.is_auto:
        names = hardware.candidates or [p.name for p in gpu_profiles]
        unknown = [name for name in names if name not in profiles]
        if unknown:
            raise PlanError(f"hardware.candidates names unknown profiles: {', '.join(unknown)}")
        # Without a known price a profile cannot be the cheapest: auto weighs the priced ones only.
        unpriced = [name for name in names if profiles[name].usd_per_month is None]
        gpu_profiles = [
            replace(profiles[name], nodes=hardware.nodes) for name in names if name not in unpriced
        ]
        if unpriced:
            notes.append(f"hardware=auto: skipped {', '.join(unpriced)} (price unknown)")
        if not gpu_profiles:
            raise PlanError(
                f"hardware=auto: no candidate has a known price (usd_per_month): {', '.join(names)}"
            )
    alts: list[Plan] = []
    refused: dict[str, str] = {}
    for p in gpu_profiles:
        try:
            alts.append(plan_on(job.but(hw=p)))
        except Unrunnable as exc:
            refused[p.name] = exc.reason
    if hardware.is_auto:
        why = "; ".join(sorted(set(refused.values())))
        if refused:
            notes.append(f"hardware=auto: skipped {', '.join(sorted(refused))} ({why})")
        if not alts:
            raise PlanError(f"hardware=auto: no candidate can run the fixed settings: {why}")
        plan = advice.choose(alts)
        plan = replace(plan, reasons=(plan.reasons[0],) + tuple(notes) + plan.reasons[1:])
    else:
        plan = plan_on(job)
    alternatives = tuple(
        advice.alternative(a, plan)
        for a in sorted(alts, key=lambda a: (advice.monthly(a.hardware), a.hardware.name))
    )
    suggestions = () if plan.fits else tuple(advice.suggestions(plan, job.but(hw=plan.hardware), alts))
    return replace(plan, alternatives=alternatives, suggestions=suggestions)
