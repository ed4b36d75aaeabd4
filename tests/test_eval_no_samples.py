"""eval.num_samples=0: the held-out loss alone, no answers generated (it crashed on max() of nothing)."""

from __future__ import annotations

from helpers import fast_eval


def test_zero_samples_scores_the_loss_and_generates_nothing(tiny_model_cfg, tiny_tokenizer, tiny_data):
    from finetune.evaluation.heldout import heldout_loss
    from finetune.evaluation.stage import evaluate_model, task_items
    from finetune.modeling import tiny

    model = tiny.load_model(tiny_model_cfg)
    evals = tiny_data[1].select(range(4))
    items = task_items(evals, 0)
    result, answers, _ = evaluate_model(
        model, tiny_tokenizer, evals, items, [], fast_eval(num_samples=0), [], "base"
    )
    assert items == [] and answers == []
    assert result == {"loss": heldout_loss(model, evals, tiny_tokenizer.pad_token_id), "generated": 0}
    assert 6.0 < result["loss"] < 8.0  # random init on a 512-token vocabulary: about ln(512) = 6.2
