"""The pipeline: plan -> data -> train -> eval -> export, each stage runnable alone (`mode=`).

Each stage reads what the previous one wrote into the run directory, so a
stage can be re-run or resumed without redoing the others.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from finetune import rundir
from finetune.core.composition import load_profiles
from finetune.core.config import RUNS_DIR, Config
from finetune.core.errors import INTERRUPTED_EXIT_CODE, ConfigError, DataError, LaunchError
from finetune.core.markup import terminal_text
from finetune.core.noise import quiet_libraries
from finetune.data import stage as data_stage
from finetune.export import hub
from finetune.launch import rollout
from finetune.launch import stage as launch_stage
from finetune.modeling import companions, outputs
from finetune.modeling.resolve import resolve_model
from finetune.pipeline import compare
from finetune.pipeline.plan_report import print_plan
from finetune.planner import Plan, make_plan
from finetune.rundir import machine, preflight
from finetune.train import tracking

# What the pipeline is doing now, for the one line a signal leaves (`cli.main`).
current_stage = "the set-up"


def _enter(stage: str) -> None:
    global current_stage
    current_stage = stage


def resolve(cfg: Config) -> Config:
    """Facts read at the edge: a local config.json or GGUF file (converted once), this machine for
    hardware=local, its memory for hardware=cpu."""
    hardware = machine.resolve_local(cfg.hardware, cfg.launch.nnodes or 1, cfg.resolved_run_dir)
    return replace(cfg, model=resolve_model(cfg.model), hardware=machine.resolve_host_hardware(hardware))


def _data_stats(run_dir: Path) -> Optional[dict]:
    """data_stats.json of the data stage, if it ran."""
    stats = run_dir / rundir.DATA_STATS_FILE
    if not stats.is_file():
        return None
    try:
        value = json.loads(rundir.read_own_text(stats))
        if not isinstance(value, dict):
            raise ValueError
        return value
    except ValueError:
        raise DataError(
            f"{stats}: unreadable (damaged?); run the data stage again (mode=data) to rewrite it"
        ) from None


def data_seq_len(run_dir: Path) -> Optional[int]:
    """The sequence length the data stage resolved for train.seq_len=auto, if it ran."""
    stats = _data_stats(run_dir)
    try:
        value = stats.get("seq_len") if stats else None
        return int(value) if value else None
    except (ValueError, TypeError):
        raise DataError(
            f"{run_dir / rundir.DATA_STATS_FILE}: unreadable (damaged?); run the data stage again (mode=data) "
            "to rewrite it"
        ) from None


def data_run_length(cfg: Config, run_dir: Path) -> Optional[tuple[int, str]]:
    """`train.dataset_tokens` from the data stage's statistics, when the run is measured in epochs and the user
    gave none: the rows the trainer steps through an epoch (the packed bins, or the examples) x the sequences
    each puts through the model x seq_len, the unit in which the planner counts a step's tokens
    (planner/timing.py). With the reason the plan prints. None for an objective that generates: its step is
    counted in completions, which the prompts alone do not give."""
    spec = cfg.objective.spec
    if cfg.train.max_steps > 0 or cfg.train.dataset_tokens is not None or cfg.objective.generates:
        return None
    stats = _data_stats(run_dir)
    if not stats:
        return None
    packing = stats.get("packing")
    if not isinstance(packing, dict):
        packing = {}
    rows, seq_len = packing.get("bins", stats.get("num_train")), stats.get("seq_len")
    if not isinstance(rows, int) or not isinstance(seq_len, int) or rows <= 0 or seq_len <= 0:
        return None
    tokens = rows * spec.sequences_per_example * seq_len
    what = "packed rows" if packing.get("enabled") else "training examples"
    return tokens, (
        f"run length: {cfg.train.epochs:g} epoch(s) of the data stage's {rows:,} {what} x {seq_len} tokens"
        + (f" x {spec.sequences_per_example} sequences" if spec.sequences_per_example > 1 else "")
        + f" = {tokens:,} tokens an epoch (data_stats.json; train.dataset_tokens overrides it)"
    )


def _precompute_reference(cfg: Config) -> Optional[bool]:
    """The objective's `reference` setting (objective.reference): precompute (True), a frozen copy (False), or the
    planner's choice (None, `auto`, and every objective without the setting)."""
    source = getattr(cfg.objective, "reference", "auto")
    return None if source == "auto" else source == "precompute"


def config_plan(
    cfg: Config, hardware: Any = None, seq_len: Optional[int] = None, profiles: Optional[dict] = None
) -> Plan:
    """The planner on this config's model, method, training, objective and packing, on `hardware` (None: the
    config's own), weighing `profiles` as alternatives (None: every profile under configs/hardware)."""
    hardware = hardware if hardware is not None else cfg.hardware
    return make_plan(
        cfg.model,
        cfg.method,
        hardware,
        _on(hardware, cfg.train),
        cfg.plan,
        load_profiles() if profiles is None else profiles,
        seq_len=seq_len,
        objective=cfg.objective.spec,
        precompute_reference=_precompute_reference(cfg),
        kl_reference=cfg.objective.spec.kl_reference(cfg.objective),
        packing=cfg.data.packing,
        companions=companions.shapes(cfg),
    )


def _on(hardware: Any, train: Any) -> Any:
    """The training settings as they apply on `hardware`: activation offloading moves activations to host
    memory, which on the CPU is where they are already, so `train.activation_offloading=true` is dropped there
    (the plan says so, `_dropped_on`) rather than handed to TRL, whose offloading needs an accelerator."""
    if hardware.device == "cpu" and train.activation_offloading:
        return replace(train, activation_offloading=False)
    return train


def _dropped_on(hardware: Any, train: Any) -> tuple[str, ...]:
    """The plan's note for each setting `_on` drops on this hardware."""
    if _on(hardware, train) is train:
        return ()
    return (
        "train.activation_offloading=true dropped: on the CPU (hardware.device=cpu) the activations are in "
        "host memory already",
    )


def plan_stage(cfg: Config, run_dir: Path, quiet: bool = False) -> Plan:
    """The plan of this run, written to plan.json: every later stage reads its `seq_len` (train.seq_len, or
    under `auto` the data stage's resolution, data_stats.json), never the config's."""
    # auto without the data stage stays None: the planner refuses it, in one line
    seq_len = data_seq_len(run_dir) if cfg.train.seq_len == "auto" else None
    generates = cfg.objective.generates
    rows_why = None
    if generates and (seq_len or cfg.train.seq_len != "auto"):
        # the rows the trainer forms from prompts and completions, when the data stage ran
        seq_len, rows_why = rollout.training_rows(cfg, run_dir, seq_len or int(cfg.train.seq_len))
    run_length = data_run_length(cfg, run_dir)
    if run_length is not None:
        cfg = replace(cfg, train=replace(cfg.train, dataset_tokens=run_length[0]))
    plan = config_plan(cfg, cfg.hardware, seq_len)

    def replan(hardware: Any) -> Plan:
        return config_plan(cfg, hardware, seq_len)

    if generates:
        plan = rollout.training_plan(cfg, plan, replan)
    # hardware=local: what was detected; the rows GRPO's trainer forms; where the run length came from
    noted = (
        *cfg.hardware.notes,
        *_dropped_on(cfg.hardware, cfg.train),
        *((rows_why,) if rows_why else ()),
        *((run_length[1],) if run_length is not None else ()),
    )
    plan = replace(plan, reasons=(*noted, *plan.reasons))
    plan = plan.with_processes(cfg.launch.nproc_per_node, cfg.launch.nnodes)  # the layout the launcher starts
    # An objective that generates: where its rollout runs (rollout.json); a server split trains on fewer ranks.
    sampling = rollout.plan_generation(cfg, run_dir, plan, replan) if generates else None
    if sampling is not None:
        plan = sampling[0]
    payload = plan.to_dict()
    rundir.write_json(run_dir / rundir.PLAN_FILE, payload)
    if cfg.plan.out:
        out = Path(cfg.plan.out)
        try:
            rundir.write_json(out, payload)
        except OSError as exc:
            raise ConfigError(f"plan.out={out}: cannot write ({exc.strerror})") from None
    if not quiet:
        print_plan(plan, title=f"{cfg.name}: {cfg.method.name} {cfg.model.name}")
        print(
            f"plan written to {run_dir / rundir.PLAN_FILE}" + (f" and {cfg.plan.out}" if cfg.plan.out else "")
        )
        if sampling is not None:
            print(rollout.describe(sampling[1]))
    return plan


def launch_ranks(cfg: Config, run_dir: Path, plan: Plan) -> int:
    """mode=launch (and training): the launcher starts the ranks, or prints how (dry run, SLURM, detach).

    When it starts them here and waits, the pre-checks run once, in this process (the machine, disk, resume,
    host RAM), and the ranks are told so (`preflight.handoff`).
    """
    return launch_stage.run(cfg, run_dir, plan, precheck=True)


def train_stage(cfg: Config, run_dir: Path, plan: Plan) -> int:
    """Train through the launcher, so one CPU process and 8 GPUs take the same path (`python -m finetune.train`)."""
    # Data a previous mode=data left: checked here, in one line, before any rank starts; after the machine
    # (a plan this machine cannot run is the first thing to say: preparing data would not help).
    if cfg.mode == "train":
        preflight.check_machine(
            cfg,
            plan,
            gpus=plan.layout.nproc_per_node,
            device=plan.hardware.device,
            allow_mismatch=cfg.launch.allow_mismatch,
        )
        data_stage.check_prepared(run_dir)
    code = launch_ranks(cfg, run_dir, plan)
    if code == INTERRUPTED_EXIT_CODE:
        # The worker's own line above says what it saved; this one must not claim more.
        print(
            "finetune: training was stopped by a signal (what it saved is said above); run the same command "
            "again to resume from the newest complete checkpoint",
            file=sys.stderr,
        )
        return code
    if code < 0:  # killed by a signal it could not handle (SIGKILL: kill -9 or the out-of-memory killer)
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        print(
            f"finetune: the training process was killed by {name} (kill -9, or the system ran out of memory); "
            "run the same command again to resume from the newest complete checkpoint",
            file=sys.stderr,
        )
        return INTERRUPTED_EXIT_CODE
    if code != 0:
        raise LaunchError(
            f"training exited with code {code}; its log is above (resume: run the same command again)"
        )
    launch = cfg.launch
    waited = not launch.dry_run and not launch.detach and launch.scheduler == "none"  # ranks ran here
    trained = rundir.trained_dir(run_dir, cfg.method.uses_adapters)
    if waited and not trained.is_dir():  # a run that trained nothing never ends as a success
        raise LaunchError(
            f"training exited with code 0 but saved no {trained.name}/; its log is above (resume: run the same "
            "command again)"
        )
    return 0


# The evaluation and export stages are imported when they run: the one exception to this module's
# module-level imports (tests/test_architecture.py). They load torch, transformers and PEFT on import
# (the chunked loss and the collator are torch modules), and mode=plan, data and launch load none of them.


def eval_stage(cfg: Config, run_dir: Path) -> dict:
    """mode=eval: base, trained and merged models on the same held-out prompts (finetune/evaluation/stage.py);
    a model already scored with these settings is not scored again unless redo=eval."""
    from finetune.evaluation import stage as evaluation

    quiet_libraries(cfg.verbose)  # transformers' bars, now that it is loaded
    return evaluation.run(cfg, run_dir, redo=cfg.redo == "eval")


def export_stage(cfg: Config, run_dir: Path, plan: Plan) -> dict:
    """mode=export: merge, check, save, serve.sh (finetune/export/stage.py)."""
    from finetune.export import stage as export

    quiet_libraries(cfg.verbose)
    return export.run(cfg, run_dir, plan)


def show_evaluation(run_dir: Path) -> None:
    """The evaluation table of eval/metrics.json, once, after the last stage that scored a model."""
    from finetune.evaluation import stage as evaluation

    evaluation.show(run_dir)


def _read_metrics(run_dir: Path) -> dict:
    """metrics.json, {} when absent or damaged (the training stage rewrites it whole)."""
    try:
        doc = json.loads(rundir.read_own_text(run_dir / rundir.METRICS_FILE))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def finished_training(cfg: Config, run_dir: Path) -> Optional[str]:
    """What a finished training run left ("400 steps, adapter/"), or None when there is training to do: the
    output metrics.json names is the one on disk, trained to the end of the length this config asks for
    (metrics.json is written when a run ends: at its last step, or stopped early)."""
    train = _read_metrics(run_dir).get("train")
    out = rundir.trained_dir(run_dir, cfg.method.uses_adapters)
    identity = outputs.identity_of(out)
    if not isinstance(train, dict) or identity is None:
        return None
    if (train.get("output_identity") or {}).get("sha256") != identity.sha256:
        return None
    if train.get("schedule") != cfg.train.length():
        return None
    return f"{train.get('steps')} steps, {out.name}/"


def finished_export(cfg: Config, run_dir: Path) -> Optional[str]:
    """What an export of the trained output left (export/, made from it), or None when there is none."""
    made_from = outputs.made_from(rundir.export_dir(run_dir))
    trained = outputs.identity_of(rundir.trained_dir(run_dir, cfg.method.uses_adapters))
    if made_from is None or trained is None or not outputs.same_model(made_from, trained):
        return None
    return f"{rundir.EXPORT_DIR}/ made from {trained.describe()}"


def _finished(stage: str, what: str, redo: str) -> None:
    print(f"{stage}: finished already ({terminal_text(what)}); redo={redo} does it again")


# What the summary lists, when this run wrote it.
SUMMARY_FILES = (
    rundir.CONFIG_FILE,
    rundir.PLAN_FILE,
    rundir.DATA_STATS_FILE,
    rundir.METRICS_FILE,
    rundir.ADAPTER_DIR,
    rundir.MODEL_DIR,
    f"{rundir.EVAL_DIR}/{rundir.EVAL_METRICS_FILE}",
    f"{rundir.EVAL_DIR}/{rundir.EVAL_REPORT_FILE}",
    f"{rundir.EXPORT_DIR}/{rundir.MERGED_DIR}",
    f"{rundir.EXPORT_DIR}/{rundir.EXPORT_ADAPTER_DIR}",
    f"{rundir.EXPORT_DIR}/{rundir.SERVE_FILE}",
)
# What a reader of the evaluation opens, beside eval/metrics.json.
EVALUATION_FILES = (rundir.EVAL_REPORT_FILE, rundir.EVAL_CURVES_FILE, rundir.EVAL_SAMPLES_FILE)


def _stamps(run_dir: Path) -> dict[str, Optional[tuple[int, int, int]]]:
    """Each summary file's (inode, mtime, size), None when absent: what changed since is what this run wrote
    (outputs are renamed into place whole, so a new one is a new inode)."""
    stamps: dict[str, Optional[tuple[int, int, int]]] = {}
    for name in SUMMARY_FILES:
        try:
            st = (run_dir / name).stat()
            stamps[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamps[name] = None
    return stamps


def _print_summary(run_dir: Path, before: dict[str, Optional[tuple[int, int, int]]]) -> None:
    """The files this run wrote (nothing an earlier run left), then where the evaluation is to be read."""
    print(f"\nrun directory: {terminal_text(run_dir)}")
    after = _stamps(run_dir)
    for name in SUMMARY_FILES:
        if after[name] is not None and after[name] != before[name]:
            print(f"  {name}")
    evaluation = rundir.eval_dir(run_dir)
    if (evaluation / rundir.EVAL_REPORT_FILE).is_file():
        shown = [n for n in EVALUATION_FILES if (evaluation / n).is_file()]
        print(
            f"evaluation: {terminal_text(evaluation / shown[0])}"
            + "".join(f", {terminal_text(evaluation / n)}" for n in shown[1:])
        )


def run(cfg: Config) -> int:
    quiet_libraries(cfg.verbose)
    cfg = resolve(cfg)
    if cfg.mode == "compare":
        out = Path(cfg.run_dir) if cfg.run_dir else Path(RUNS_DIR) / rundir.COMPARE_DIR
        rundir.check_run_dir(out)
        compare.run(cfg.runs, out)
        rundir.mark_owned(out)
        return 0
    if cfg.redo == "train":  # starts over: the checkpoints of the finished run are not resumed
        cfg = replace(cfg, resume=False)
    run_dir = rundir.prepare(cfg)
    before = _stamps(run_dir)
    rundir.check_resumable(cfg, run_dir)
    rundir.save_config(cfg, run_dir)
    mode = cfg.mode
    if mode == "plan":
        _enter("the plan stage")
        plan_stage(cfg, run_dir)
        return 0
    if mode in ("train", "eval", "export", "all"):  # the trackers installed, before anything runs
        tracking.check_installed(cfg)
    if mode in ("export", "all"):  # export.push_to_hub: the Hub asked before hours of training, not after
        hub.check_reachable(cfg)
    if mode in ("data", "all"):
        _enter("the data stage")
        data_stage.run(cfg, run_dir)
        if mode == "data":
            return 0
    if mode == "launch":
        _enter("the launch stage")
        return launch_ranks(cfg, run_dir, plan_stage(cfg, run_dir, quiet=True))
    _enter("the plan stage")
    plan = plan_stage(cfg, run_dir, quiet=mode in ("eval", "export"))
    cfg = replace(
        cfg, hardware=plan.hardware
    )  # from here on the plan's profile (hardware=auto: the chosen one)
    if mode in ("train", "all"):
        _enter("the training stage")
        # resume=false or a checkpoint path asks for training: only resume=true finds it finished
        trained = finished_training(cfg, run_dir) if cfg.resume is True else None
        if trained is not None:
            _finished("training", trained, "train")
        else:
            code = train_stage(cfg, run_dir, plan)
            if code:
                return code
    if mode in ("eval", "all"):
        _enter("the evaluation stage")
        eval_stage(cfg, run_dir)
    if mode in ("export", "all"):
        _enter("the export stage")
        exported = finished_export(cfg, run_dir) if cfg.redo != "export" else None
        if exported is not None:
            _finished("export", exported, "export")
        else:
            export_stage(cfg, run_dir, plan)
    if mode in ("eval", "export", "all"):
        show_evaluation(run_dir)
        # the config, plan, scores and report to the run's MLflow run
        tracking.log_results(cfg, run_dir)
    _print_summary(run_dir, before)
    return 0
