"""Under `init_from=RUN_DIR` (SFT, then DPO) the evaluation's `base` is the model training started from.

The report's base column then says whether this run helped over its starting point: for an adapter method
it is the earlier run's adapter on the base (DPO's own reference), not the plain base; the trained variant
is this run's adapter on the plain base (it continued the earlier adapter, so it holds all of it).
"""

from __future__ import annotations

import torch
from helpers import make_adapter_run, tiny_cfg

from finetune.modeling import tiny
from finetune.modeling.loading import attach_adapter
from finetune.modeling.variants import load_variant


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_base_under_init_from_is_the_earlier_runs_adapter(tmp_path, tiny_cache):
    cfg = tiny_cfg("objective=dpo", "method.lora_dropout=0.0")
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    sft_adapter = make_adapter_run(sft, cfg.model, cfg.method, seed=1)
    make_adapter_run(dpo, cfg.model, cfg.method, seed=2)
    started = tiny_cfg("objective=dpo", "method.lora_dropout=0.0", f"init_from={sft}", run_dir=dpo)
    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])

    plain = _logits(tiny.load_model(cfg.model).eval(), ids)
    expected_base = _logits(attach_adapter(tiny.load_model(cfg.model), sft_adapter).eval(), ids)
    expected_trained = _logits(attach_adapter(tiny.load_model(cfg.model), dpo / "adapter").eval(), ids)

    base = _logits(load_variant(started, dpo, "base").eval(), ids)
    trained = _logits(load_variant(started, dpo, "trained").eval(), ids)
    torch.testing.assert_close(base, expected_base, rtol=0, atol=1e-6)
    torch.testing.assert_close(trained, expected_trained, rtol=0, atol=1e-6)
    assert (base - plain).abs().max() > 1e-3  # the SFT'd adapter, not the plain base
    # without init_from the base is the plain base, as before
    torch.testing.assert_close(_logits(load_variant(cfg, dpo, "base").eval(), ids), plain, rtol=0, atol=1e-6)
