"""Where a CPU training step's resident memory goes, on the real training path of a run directory.

    python scripts/probe_cpu_step_memory.py RUN_DIR COPY_DIR    # RUN_DIR: one that mode=data and mode=train planned

It copies RUN_DIR (without checkpoints) to COPY_DIR, builds the model and the trainer there as the training
worker does (finetune.train.stage), touches the weights (file-backed pages of the safetensors file), then
runs one forward with the loss (the chunked loss makes its gradients in the forward) and prints: the
anonymous RSS before, the forward's peak, the bytes autograd saved for backward (distinct storages, the
parameters excluded), and the anonymous RSS after glibc's malloc_trim(0) gives back the freed heap. The
last two differ from the peak by what glibc keeps of the forward's freed temporaries (BENCHMARKS.md,
"SmolLM2-135M-Instruct on the CPU").
"""

import ctypes
import shutil
import sys
from dataclasses import replace
from pathlib import Path


def status() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, *value = line.split()
        if key in ("VmHWM:", "VmRSS:", "RssAnon:", "RssFile:"):
            out[key[:-1]] = int(value[0]) / 1e6
    return out


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def main() -> None:
    src, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    if not run_dir.exists():
        skip = shutil.ignore_patterns("checkpoints", "tensorboard", "adapter", "metrics.json", ".lock*")
        shutil.copytree(src, run_dir, ignore=skip)
    import torch

    from finetune import rundir
    from finetune.train import stage

    plan = rundir.load_plan(run_dir)
    cfg = replace(rundir.load_config(run_dir), hardware=plan.hardware, run_dir=str(run_dir))
    datasets = stage._load_data(run_dir, None)
    loaded = stage._load_model(cfg, plan, run_dir)
    trainer = stage._build_session(cfg, plan, run_dir, loaded, datasets, 0.0, True).trainer
    model = trainer.model
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    before = status()
    reset_peak()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.compute_loss(model, batch)
    forward = status()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = status()
    acts = sum(n for ptr, n in saved.items() if ptr not in params) / 1e9
    print(
        f"GB: anon before {before['RssAnon']:.3f}, file {before['RssFile']:.3f} | forward peak RSS "
        f"{forward['VmHWM']:.3f}, anon {forward['RssAnon']:.3f} | saved for backward {acts:.3f} | "
        f"anon after malloc_trim {trimmed['RssAnon']:.3f}"
    )
    print("plan GB:", rundir.load_plan(run_dir).gpu_memory)


if __name__ == "__main__":
    main()
