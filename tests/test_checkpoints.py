"""Atomic checkpoints: sealed by a checksummed manifest, damaged ones skipped, the last K kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import adapter_weights, losses, tiny_cfg, train_run

from finetune.core.errors import ConfigError
from finetune.rundir import checkpoints


def _fake(folder: Path, step: int, seal: bool = True) -> Path:
    """A checkpoint-like folder: staged then sealed (or left unsealed, as a crash mid-save would), its
    optimizer state and adapter readable as the trainer reads them (`checkpoints.verify` opens them)."""
    import torch
    from safetensors.torch import save_file

    staged = folder / checkpoints.STAGING_DIR / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    torch.save({"state": {0: {"exp_avg": torch.randn(1000)}}, "param_groups": []}, staged / "optimizer.pt")
    save_file({"lora_A": torch.randn(250)}, str(staged / "adapter_model.safetensors"))
    (staged / "sub").mkdir()
    (staged / "sub" / "rank1.pt").write_bytes(b"x" * 100)
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if not seal:
        final = folder / staged.name
        os.replace(staged, final)
        return final
    return checkpoints.finalize(staged, folder / f"checkpoint-{step}")


def _same_size_noise(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def test_finalize_seals_with_sizes_and_checksums(tmp_path):
    ckpt = _fake(tmp_path, 10)
    manifest = json.loads((ckpt / checkpoints.MANIFEST).read_text())
    assert manifest["step"] == 10
    assert set(manifest["files"]) == {
        "optimizer.pt",
        "adapter_model.safetensors",
        "sub/rank1.pt",
        "trainer_state.json",
    }
    assert manifest["files"]["optimizer.pt"]["bytes"] == (ckpt / "optimizer.pt").stat().st_size
    assert len(manifest["files"]["optimizer.pt"]["sha256"]) == 64
    assert checkpoints.verify(ckpt) is None
    assert not (tmp_path / checkpoints.STAGING_DIR / "checkpoint-10").exists()


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c: (c / "optimizer.pt").write_bytes(b"short"), "truncated"),
        (lambda c: (c / "sub" / "rank1.pt").unlink(), "missing"),
        (lambda c: (c / checkpoints.MANIFEST).unlink(), "no manifest.json"),
        (lambda c: (c / checkpoints.MANIFEST).write_text("{"), "unreadable"),
        (lambda c: _same_size_noise(c / "adapter_model.safetensors"), "SHA-256"),
    ],
)
def test_damaged_newest_is_skipped_for_the_previous(tmp_path, damage, reason):
    _fake(tmp_path, 5)
    newest = _fake(tmp_path, 10)
    damage(newest)
    assert reason in checkpoints.verify(newest)
    assert checkpoints.last_complete(tmp_path) == tmp_path / "checkpoint-5"


def test_same_size_corruption_needs_checksums(tmp_path):
    ckpt = _fake(tmp_path, 3)
    _same_size_noise(ckpt / "optimizer.pt")
    assert checkpoints.verify(ckpt, checksums=False) is None  # rotation's cheap check
    assert "SHA-256" in checkpoints.verify(ckpt)  # resume's full check


def test_unsealed_checkpoint_from_a_crash_is_never_resumed(tmp_path):
    _fake(tmp_path, 4)
    _fake(tmp_path, 8, seal=False)
    assert checkpoints.last_complete(tmp_path) == tmp_path / "checkpoint-4"
    assert checkpoints.last_complete(tmp_path / "none") is None


def test_rotate_keeps_newest_k_complete_and_drops_damaged(tmp_path):
    for step in (2, 4, 6, 8):
        _fake(tmp_path, step)
    (tmp_path / "checkpoint-6" / "optimizer.pt").write_bytes(b"")
    newest = _fake(tmp_path, 10)
    deleted = checkpoints.rotate(tmp_path, keep=2, protect=newest)
    assert sorted(p.name for p in deleted) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert [p.name for p in checkpoints.listing(tmp_path)] == ["checkpoint-8", "checkpoint-10"]


def test_finalize_replaces_an_existing_step_and_staging_is_cleaned(tmp_path):
    old = _fake(tmp_path, 7)
    (old / "stale.bin").write_bytes(b"old")
    new = _fake(tmp_path, 7)
    assert not (new / "stale.bin").exists() and checkpoints.verify(new) is None
    (tmp_path / checkpoints.STAGING_DIR / "checkpoint-9").mkdir(parents=True)
    (tmp_path / ".replaced-checkpoint-3").mkdir()
    checkpoints.clean_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-7"]


def test_supersede_and_discard(tmp_path):
    for step in (5, 10, 15):
        _fake(tmp_path, step)
    moved = checkpoints.supersede_after(tmp_path, 5)
    assert sorted(p.name for p in moved) == ["superseded-checkpoint-10", "superseded-checkpoint-15"]
    assert checkpoints.last_complete(tmp_path) == tmp_path / "checkpoint-5"
    assert checkpoints.discard_all(tmp_path) == 1 and checkpoints.listing(tmp_path) == []


def test_resume_setting_picks_the_checkpoint(tmp_path):
    from finetune.pipeline.cli import compose
    from finetune.rundir.checkpoints import resume_checkpoint

    run = tmp_path / "run"
    folder = run / "checkpoints"
    for step in (4, 8):
        _fake(folder, step)
    (folder / "checkpoint-8" / "optimizer.pt").write_bytes(b"")
    cfg = compose([f"run_dir={run}"])
    assert resume_checkpoint(cfg.resume, folder) == str(
        folder / "checkpoint-4"
    )  # resume=true: newest complete
    assert resume_checkpoint(False, folder) is None
    assert resume_checkpoint("checkpoint-4", folder) == str(folder / "checkpoint-4")
    assert resume_checkpoint(str(folder / "checkpoint-4"), folder) == str(folder / "checkpoint-4")
    with pytest.raises(
        ConfigError, match=r"resume=checkpoint-8: damaged checkpoint \(optimizer.pt has 0 bytes"
    ):
        resume_checkpoint("checkpoint-8", folder)
    with pytest.raises(
        ConfigError, match="no such checkpoint folder .this run has: checkpoint-4, checkpoint-8"
    ):
        resume_checkpoint("checkpoint-99", folder)


# ---------------------------------------------------------------- through the real trainer


# 12 steps of 2 x 2 rows, a checkpoint every 4 (the last 3 kept), dropout on: the RNG state must round-trip too.
TWELVE_STEPS = (
    "train.warmup_ratio=0.0",
    "method.lora_dropout=0.1",
    "train.max_steps=12",
    "train.save_steps=4",
    "train.save_total_limit=3",
)


def _train(run: Path, tiny_data) -> dict:
    cfg = tiny_cfg(*TWELVE_STEPS, run_dir=run)
    return train_run(cfg, tiny_data, n_eval=8, max_generate=2, micro_batch_size=2, grad_accum_steps=2)


def test_truncated_newest_checkpoint_resumes_from_previous_exactly(tmp_path, tiny_cache, tiny_data):
    """Truncate checkpoint-12's optimizer: resume=true picks checkpoint-8 and retraces 9-12 bit for bit."""
    import torch

    run = tmp_path / "run"
    first = _train(run, tiny_data)
    folder = run / "checkpoints"
    assert [p.name for p in checkpoints.listing(folder)] == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert all(checkpoints.verify(p) is None for p in checkpoints.listing(folder))
    assert not (folder / checkpoints.STAGING_DIR).exists()
    reference_losses = losses(folder / "checkpoint-12")
    reference_adapter = adapter_weights(run)
    assert first["train"]["resumed_from"] is None

    optimizer = folder / "checkpoint-12" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    again = _train(run, tiny_data)
    assert again["train"]["resumed_from"] == str((folder / "checkpoint-8").resolve())
    assert checkpoints.verify(folder / "checkpoint-12") is None  # rewritten whole
    assert losses(folder / "checkpoint-12") == reference_losses
    resumed = adapter_weights(run)
    assert all(torch.equal(resumed[k], reference_adapter[k]) for k in reference_adapter)


def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path, tiny_cache, tiny_data, monkeypatch):
    """A save that dies before it is sealed is never renamed into place; the next run resumes the one before."""
    run = tmp_path / "run"
    real = checkpoints.write_manifest
    calls = []

    def dies_on_second_save(folder, step):
        calls.append(step)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(folder, step)

    monkeypatch.setattr(checkpoints, "write_manifest", dies_on_second_save)
    with pytest.raises(OSError, match="No space left"):
        _train(run, tiny_data)
    folder = run / "checkpoints"
    assert [p.name for p in checkpoints.listing(folder)] == ["checkpoint-4"]
    assert (folder / checkpoints.STAGING_DIR / "checkpoint-8").is_dir()  # the half-written one, unnamed
    monkeypatch.setattr(checkpoints, "write_manifest", real)
    m = _train(run, tiny_data)
    assert (
        m["train"]["resumed_from"] == str((folder / "checkpoint-4").resolve()) and m["train"]["steps"] == 12
    )
    assert not (folder / checkpoints.STAGING_DIR / "checkpoint-8").exists()
