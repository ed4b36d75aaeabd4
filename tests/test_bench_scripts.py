"""The benchmark scripts end to end on tiny shapes: the GPU check's CPU path and the calibration loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python ARGS` (a script under scripts/) from the repository root; it must succeed."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`gpu_check.py --cpu` on one tiny case and one tiny QLoRA case, written to a folder."""
    out = tmp_path_factory.mktemp("gpu-check")
    _script(str(SCRIPTS / "gpu_check.py"), str(out), "--cpu", "--steps", "2", "--only", "tiny-")
    return out


def test_gpu_check_cpu_writes_the_table_and_json(cpu_check: Path):
    results = json.loads((cpu_check / "results.json").read_text())
    assert results["meta"]["device"] == "cpu" and results["meta"]["versions"]["torch"]
    names = [r["case"]["name"] for r in results["rows"]]
    assert names == ["tiny-lora", "tiny-qlora-ckpt", "tiny-full-8bit"]
    for row in results["rows"]:
        res, plan = row["result"], row["plan_gb"]
        assert res["status"] == "ok", res
        # what ran, recorded for calibrate.py: the trainer's autocast and packed rows, the method's adapters
        case = row["case"]
        assert (case["harness"], case["autocast"], case["packed"]) == ("gpu_check-v2", True, True)
        assert case["adapter_dtype"] == ("bf16" if case["method"] == "qlora" else "fp32")
        assert res["steps"] == 2 and len(res["losses"]) == 2
        assert all(loss == loss and 0 < loss < 20 for loss in res["losses"])  # finite, about ln(512)
        assert res["tokens_per_s"] > 0 and res["mfu"] is None  # no peak FLOP/s for a CPU
        # the RSS peak holds at least the planned terms, and the process itself (torch) on top
        terms = plan["total"] - plan["overhead"]
        assert terms > 0 and plan["tensors"] >= terms - 1e-3 and res["rss_peak_gb"] > plan["tensors"]
        assert plan["tensors"] <= plan["total"]
        assert set(plan) == {
            "weights",
            "trainable_state",
            "activations",
            "logits",
            "overhead",
            "total",
            "tensors",
            "fluctuating",
        }
        assert row["error_device_vs_total"] == pytest.approx(
            (plan["total"] - res["device_peak_gb"]) / res["device_peak_gb"], abs=1e-3
        )
    md = (cpu_check / "results.md").read_text()
    assert md.startswith("# GPU check: CPU")
    assert "| tiny-lora | ok | 2 |" in md and "| tiny-full-8bit | ok | 2 |" in md


def test_calibrate_updates_a_copy_and_shows_before_after(cpu_check: Path, tmp_path: Path):
    original = ROOT / "finetune" / "planner" / "calibration.json"
    before_text = original.read_text()
    copy = tmp_path / "calibration.json"
    copy.write_text(before_text)
    proc = _script(str(SCRIPTS / "calibrate.py"), str(cpu_check / "results.json"), "--calibration", str(copy))
    assert (
        "| case | measured peak GB | plan before GB | error before | plan after GB | error after |"
        in proc.stdout
    )
    assert "tiny-qlora-ckpt" in proc.stdout and "cpu.fixed_gb" in proc.stdout
    old, new = json.loads(before_text), json.loads(copy.read_text())
    assert set(new) == set(old) and set(new["cpu"]) == set(old["cpu"]) | {"_calibrated"}
    # a --cpu run informs only the CPU process's fixed share
    assert new["cuda"] == old["cuda"] and {k: v for k, v in new.items() if k != "cpu"} == {
        k: v for k, v in old.items() if k != "cpu"
    }
    assert {k: v for k, v in new["cpu"].items() if k not in ("fixed_gb", "_calibrated")} == {
        k: v for k, v in old["cpu"].items() if k != "fixed_gb"
    }
    # refitted so that every measured RSS peak is covered by the plan's total
    results = json.loads((cpu_check / "results.json").read_text())
    rows = results["rows"]
    sys.path.insert(0, str(SCRIPTS))
    from gpu_check import plan_terms

    from finetune.planner import Calibration

    cal = Calibration.from_dict(new)
    for row in rows:
        assert plan_terms(row["case"], cal)["total"] >= row["result"]["rss_peak_gb"] - 1e-3
    assert original.read_text() == before_text  # the shipped file is untouched

    dry = _script(
        str(SCRIPTS / "calibrate.py"),
        str(cpu_check / "results.json"),
        "--calibration",
        str(copy),
        "--dry-run",
    )
    assert "nothing written" in dry.stdout and json.loads(copy.read_text()) == new


def test_calibrate_reproduces_the_shipped_cuda_fit(tmp_path: Path):
    """The CUDA section of calibration.json is what calibrate.py fits to the stored H200 rows, and every
    plannable total then lies within +10% and -3% of its device peak."""
    original = ROOT / "finetune" / "planner" / "calibration.json"
    copy = tmp_path / "calibration.json"
    copy.write_text(original.read_text())
    proc = _script(
        str(SCRIPTS / "calibrate.py"),
        str(SCRIPTS / "gpu_results" / "h200-issue13.json"),
        "--calibration",
        str(copy),
    )
    assert "target (every total within +10% and -3% of its device peak): met" in proc.stdout
    assert "| 8b-lora-8k-plain-loss | 36.780 | - | no plan takes this loss path |" in proc.stdout
    fitted, shipped = json.loads(copy.read_text())["cuda"], json.loads(original.read_text())["cuda"]
    assert {k: v for k, v in fitted.items() if not k.startswith("_")} == {
        k: v for k, v in shipped.items() if not k.startswith("_")
    }


def test_bench_planner_quick_prints_measured_vs_planned(tmp_path: Path):
    out = tmp_path / "bench.json"
    proc = _script(str(SCRIPTS / "bench_planner.py"), "--quick", "--only", "tiny lora", "--json", str(out))
    assert (
        "| shape | case | tokens | weights | trainable_state | activations | logits | total |" in proc.stdout
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["lora chunked", "lora trl", "lora ckpt chunked", "lora ckpt trl"]
    for r in rows:
        m, p = r["measured"], r["planned"]
        # parameter and training-state bytes are exact; activations within the 10% target
        assert m["weights"] == pytest.approx(p["weights"], rel=1e-6)
        assert m["trainable_state"] == pytest.approx(p["trainable_state"], rel=1e-3)
        assert m["activations"] == pytest.approx(p["activations"], rel=0.10)
        assert m["logits"] == pytest.approx(p["logits"], rel=0.10)  # either loss path, as the trainer runs it
        assert m["total"] == pytest.approx(p["total"], rel=0.05)


def test_bench_library_parts_measures_each_kept_part(tmp_path: Path):
    """The reasons written beside the kept hand-written parts, re-measured (BENCHMARKS.md's section)."""
    env_cache = {"FINETUNE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_library_parts.py"), "--convs", "300"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env_cache},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| finetune PackedCollator | (3, 128) | yes | (3, 1, 128, 128) |" in out
    assert "| TRL DataCollatorForLanguageModeling (padded, position ids) | (3, 128) | NO |" in out
    assert "| TRL DataCollatorForLanguageModeling (padding_free) | (1, 312) | yes |" in out
    assert "0.27 GB for rows kept apart and 1.07 GB (4x)" in out
    assert '| include_num_input_tokens_seen="non_padding" (ids != pad) | 58,870 | -9.4% |' in out
    assert "| reduce_bucket_size | 500,000,000 | 67,108,864 | 67,108,864 |" in out
    assert "| transformers get_last_checkpoint | checkpoint-2 (truncated) |" in out
    assert "| finetune checkpoints.last_complete (manifest sizes + SHA-256) | checkpoint-1 |" in out


@pytest.mark.extended  # two processes' start-up and data stage: ~1.5 min on 2 idle cores
def test_bench_dpo_overhead_quick_runs_both_sides_on_the_same_pairs(tmp_path: Path):
    """finetune's DPO step and the plain TRL DPOTrainer script do the same work: the first DPO loss is log 2 on
    both (a fresh adapter: the policy is its reference), the last is the same loss (same seed, arguments and
    pairs; the script stops on any DPOConfig field that differs), and the table gives the ratio."""
    out = tmp_path / "overhead.json"
    proc = _script(str(SCRIPTS / "bench_dpo_overhead.py"), "--quick", "--json", str(out), timeout=1500)
    assert "| training loop | **overhead** |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["steps"] == 2
    for side in ("finetune", "plain"):
        (run,) = result[side]
        assert run["first_loss"] == pytest.approx(0.6931, abs=1e-3)
        assert run["loop"] > 0 and run["whole"] >= run["loop"]
        # the loop's CPU seconds (one intra-op thread each): at most the wall clock's, plus the odd clock tick
        assert 0 < run["cpu"] <= run["loop"] * 1.05
    assert result["finetune"][0]["last_loss"] == pytest.approx(result["plain"][0]["last_loss"], rel=1e-5)
