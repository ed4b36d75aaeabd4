"""Vision-language models: the image record kind chosen by the model's architecture, the processor's
assistant-only labels (image tokens never labelled), remote images refused, LoRA held to the language model
unless `method.lora_vision`, QLoRA's 16-bit vision tower, and the tiny VLM's whole pipeline on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, run_modes

from finetune.core.architectures import ARCHITECTURES, refusal
from finetune.core.errors import ConfigError
from finetune.pipeline.cli import compose

VLM = "+recipe=tiny_vlm"


def test_the_model_chooses_the_image_record_kind():
    assert compose([VLM]).record_kind == "image_conversations"
    assert compose(["+recipe=tiny"]).record_kind == "conversations"
    # an objective whose records carry no images is refused on a model that takes them, in one line
    with pytest.raises(ConfigError, match="objective=dpo has no image data"):
        compose([VLM, "objective=dpo"])
    assert [n for n, a in ARCHITECTURES.items() if a.takes_images] == [
        "idefics3",
        "smolvlm",
        "qwen2_5_vl",
        "qwen3_vl",
        "gemma3",
    ]
    assert "vision-language family" in (refusal("mllama") or "")


def test_image_tokens_follow_the_processors_rules():
    model = compose([VLM]).model
    # 64 x 64 pixels in 8 x 8 patches: 64 patches, merged 2 x 2 into 16 language-model tokens
    assert model.image_tokens == (64 // 8) ** 2 // 4 == 16


@pytest.fixture(scope="module")
def processor(tiny_cache):
    from finetune.modeling import models

    return models.load_tokenizer(compose([VLM]).model)


def test_labels_are_the_assistant_text_only(processor):
    from finetune.data import shapes
    from finetune.modeling.vision import rendered

    path = shapes.bundled_path()
    record = json.loads(path.read_text().splitlines()[0])
    messages = record["messages"]
    image = (path.parent / messages[0]["content"][0]["image"]).read_bytes()
    messages[0]["content"][0] = {"type": "image"}
    out = rendered(processor, [messages], [[image]], with_labels=True)
    ids, labels = out["input_ids"][0], out["labels"][0]
    image_positions = ids == processor.image_token_id
    assert int(image_positions.sum()) == 16  # the processor's image tokens are in the sequence
    assert bool((labels[image_positions] == -100).all())  # and never labelled
    labelled = labels[labels != -100]
    answer = messages[1]["content"]
    assert processor.tokenizer.decode(labelled) == answer + "<|end|>"
    assert out["pixel_values"].shape[-2:] == (64, 64)  # resized by the processor to model.image_size


def test_a_remote_image_is_refused_in_one_line(tmp_path, tiny_cache):
    data = tmp_path / "remote.jsonl"
    part = {"type": "image", "image": "https://example.com/cat.png"}
    record = {
        "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "cat"},
        ]
    }
    data.write_text(json.dumps(record) + "\n")
    proc = run_cli("mode=data", VLM, f"data.path={data}", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert "remote address; images are read from local files only" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_image_folder_gives_each_of_its_images(tmp_path):
    from PIL import Image

    from finetune.data.image_conversations import _image_files

    (tmp_path / "pics").mkdir()
    for name in ("b.png", "a.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / "pics" / name)
    (tmp_path / "pics" / "notes.txt").write_text("not an image")
    assert [p.name for p in _image_files("pics", tmp_path, "x:1")] == ["a.png", "b.png"]


def test_lora_stays_on_the_language_model_unless_asked(tiny_cache):
    import re

    from finetune.modeling.loading import lora_config, quantization_config

    frozen, adapted = compose([VLM, "method.lora_vision=false"]), compose([VLM])
    names = [
        "model.text_model.layers.0.self_attn.q_proj",
        "model.text_model.layers.1.mlp.down_proj",
        "model.vision_model.encoder.layers.0.self_attn.q_proj",
        "model.vision_model.encoder.layers.0.mlp.fc1",
    ]

    def targeted(cfg):
        pattern = lora_config(cfg.method, cfg.model).target_modules
        return [n for n in names if re.fullmatch(pattern, n)]

    assert targeted(frozen) == names[:2]
    assert targeted(adapted) == names
    assert lora_config(adapted.method, adapted.model).modules_to_save == ["connector"]
    qlora = compose([VLM, "method=qlora"])
    skip = quantization_config(qlora.method, None, model=qlora.model).llm_int8_skip_modules
    assert skip == ["vision_model", "connector", "lm_head"]  # the vision tower stays in 16 bits


@pytest.mark.slow
def test_tiny_vlm_learns_the_shapes_and_exports(tmp_path, tiny_cache):
    """data, train, eval and export of the tiny VLM on the CPU: the trained model answers held-out image
    questions the base cannot, and the merged export scores as the trained adapter."""
    run = tmp_path / "vlm"
    args = [VLM, f"run_dir={run}", "train.max_steps=60", "eval.num_samples=40"]
    run_modes(args, run, timeout=900, modes=("data", "train", "eval", "export"))
    scores = json.loads((run / "eval" / "metrics.json").read_text())
    assert scores["base"]["exact_match"] == 0.0
    assert scores["trained"]["exact_match"] >= 0.2
    assert scores["trained"]["loss"] < scores["base"]["loss"] / 2
    assert scores["merged"]["exact_match"] == scores["trained"]["exact_match"]
    stats = json.loads((run / "data_stats.json").read_text())
    assert stats["images"]["image_tokens"] == 16 * (stats["num_train"] + stats["num_eval"])
    assert (run / "export" / "merged" / "processor_config.json").is_file()
    engine = json.loads((run / "metrics.json").read_text())["train"]["engine"]
    assert engine["world_size"] == 1 and engine["loss"] == "trl"


def _train_two_ranks(tmp_path: Path, *extra: str) -> dict:
    run = tmp_path / "run"
    args = [
        VLM,
        f"run_dir={run}",
        "hardware.gpus_per_node=2",
        "train.max_steps=3",
        "train.save_steps=3",
        "train.eval_steps=1000",
        *extra,
    ]
    run_modes(args, run, timeout=900)
    return json.loads((run / "metrics.json").read_text())["train"]["engine"]


@pytest.mark.slow
@pytest.mark.distributed
def test_tiny_vlm_trains_under_ddp(tmp_path, tiny_cache):
    engine = _train_two_ranks(tmp_path)
    assert engine["world_size"] == 2 and engine["backend"] == "gloo"
    assert engine["wrapper"] == "DistributedDataParallel"


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("sharding", ["zero3", "fsdp"])
def test_tiny_vlm_trains_sharded(tmp_path, tiny_cache, sharding):
    engine = _train_two_ranks(tmp_path, f"train.sharding={sharding}", f"train.engine={sharding}")
    assert engine["world_size"] == 2
    if sharding == "zero3":
        assert engine["wrapper"] == "DeepSpeedEngine" and engine["zero_stage"] == 3
    else:
        assert engine["wrapper"].startswith("FSDP")
    for r in engine["ranks"]:
        assert r["parameters_held"] < 0.6 * r["parameters"]


@pytest.mark.slow
def test_tiny_vlm_trains_in_bf16_on_the_cpu(tmp_path, tiny_cache):
    run = tmp_path / "bf16"
    args = [VLM, f"run_dir={run}", "method.precision=bf16", "train.max_steps=2", "train.eval_steps=1000"]
    run_modes(args, run, timeout=900)
    engine = json.loads((run / "metrics.json").read_text())["train"]["engine"]
    assert engine["mixed_precision"] == "bf16"
    assert "bfloat16" in engine["parameter_dtypes"]


QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}


def test_a_qwen25_vl_config_json_plans_in_one_command(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN25_VL_7B))
    run = tmp_path / "plan"
    proc = run_cli("mode=plan", f"model.config_path={path}", "hardware=h100", "method=lora", f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["params"]["total"] == 8_292_166_656  # the checkpoint's parameter count
    assert "images: 256 tokens a picture at 448 px" in proc.stdout.replace("\n", " ")
    # the preset states the same shape
    preset = compose(["model=qwen2_5_vl_7b"]).model
    from finetune.planner.params import count_params

    assert count_params(preset).total == 8_292_166_656


def test_a_vision_family_not_modelled_is_refused_in_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN25_VL_7B, "model_type": "qwen2_vl"}))
    proc = run_cli("mode=plan", f"model.config_path={path}", "hardware=h100", f"run_dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    assert "qwen2_vl is a vision-language family whose image side the planner does not model" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_planned_counts_match_the_built_tiny_vlm(processor):
    from finetune.modeling import models
    from finetune.modeling.loading import add_adapters, load_pretrained
    from finetune.planner.params import count_params, lora_params

    cfg = compose([VLM])
    model = load_pretrained(cfg.model, models.model_source(cfg.model))
    side = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("model.vision", "model.conn")))
    counts = count_params(cfg.model)
    assert (counts.vision, counts.total) == (side, sum(p.numel() for p in model.parameters()))
    adapted = add_adapters(model, cfg.method, cfg.model)
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == lora_params(
        cfg.model, cfg.method
    )


def test_qwen25_vl_counts_match_transformers_on_meta_device(tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.planner.params import count_params

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN25_VL_7B))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(path)))
    visual = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual"))
    counts = count_params(compose(["model=qwen2_5_vl_7b"]).model)
    assert (counts.vision, counts.total) == (visual, sum(p.numel() for p in model.parameters()))
