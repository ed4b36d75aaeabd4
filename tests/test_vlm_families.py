"""Vision-language families beyond the tiny VLM: SmolVLM, Gemma 3 (image-text) and Qwen3-VL. Each preset's
counts equal transformers' own model built from the hub's config.json on the meta device (no download); the
config.json plans in one command with the preset's totals; image tokens a picture follow the processor's
resize and patch rules, checked against the processor itself where it builds offline. Llama 3.2 Vision is
refused in one line naming what is not modelled."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli

from finetune.core.config import MethodConfig
from finetune.core.errors import ConfigError
from finetune.pipeline.cli import compose
from finetune.planner.params import count_params, lora_params, vision_lora_params, vision_params

# The hub's config.json of each model (the keys it states; transformers' class defaults fill the rest).
SMOLVLM2_500M = {
    "architectures": ["SmolVLMForConditionalGeneration"],
    "image_token_id": 49190,
    "model_type": "smolvlm",
    "pad_token_id": 128002,
    "scale_factor": 4,
    "text_config": {
        "head_dim": 64,
        "hidden_size": 960,
        "intermediate_size": 2560,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 15,
        "num_hidden_layers": 32,
        "num_key_value_heads": 5,
        "pad_token_id": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000,
        "vocab_size": 49280,
    },
    "tie_word_embeddings": False,
    "vision_config": {
        "hidden_size": 768,
        "image_size": 512,
        "max_image_size": {"longest_edge": 512},
        "model_type": "smolvlm_vision",
        "num_attention_heads": 12,
        "patch_size": 16,
        "size": {"longest_edge": 2048},
    },
    "vocab_size": 49280,
}
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "model_type": "gemma3_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_size": 1152,
        "in_channels": 3,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
# preset: (its hub config.json, the encoder and projector's module prefixes, total, vision, image tokens)
FAMILIES = {
    "smolvlm2_500m": (
        SMOLVLM2_500M,
        ("model.vision_model", "model.connector"),
        507_482_304,
        98_229_504,
        1088,
    ),
    "gemma3_12b_vision": (
        GEMMA3_12B,
        ("model.vision_tower", "model.multi_modal_projector"),
        12_187_325_040,
        421_290_864,
        256,
    ),
    "qwen3_vl_8b": (QWEN3_VL_8B, ("model.visual",), 8_767_123_696, 576_388_336, 196),
}


def _write(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("preset", FAMILIES)
def test_preset_counts_match_transformers_on_meta_device(tmp_path, preset):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config, prefixes, total, vision, _ = FAMILIES[preset]
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            AutoConfig.from_pretrained(str(_write(tmp_path, config)))
        )
    side = sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes))
    built = sum(p.numel() for p in model.parameters())
    counts = count_params(compose([f"model={preset}"]).model)
    assert (counts.vision, counts.total) == (side, built) == (vision, total)


@pytest.mark.parametrize("preset", FAMILIES)
def test_hub_config_json_plans_as_its_preset_in_one_command(tmp_path, preset):
    from helpers import planned

    from finetune.core.config import ModelConfig
    from finetune.modeling.resolve import model_from_config_json

    config, _, total, vision, image_tokens = FAMILIES[preset]
    run = tmp_path / "plan"
    path = _write(tmp_path, config)
    # `model=FOLDER`: the folder save_pretrained (or the hub) gives, holding the config.json
    proc = run_cli("mode=plan", f"model={path.parent}", "hardware=h100", "method=lora", f"run_dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["params"]["total"] == total
    assert f"images: {image_tokens} tokens a picture" in proc.stdout.replace("\n", " ")
    # the preset plans the same model: what the config.json says, field for field
    read = model_from_config_json(ModelConfig(config_path=str(path)))
    cfg, preset_plan = planned(f"model={preset}", "hardware=h100", "method=lora")
    assert preset_plan.to_dict()["params"]["total"] == total
    fields = (
        "architecture",
        "hidden_size",
        "num_layers",
        "vision_layers",
        "vision_token_merge",
        "image_crops",
    )
    assert [getattr(read, f) for f in fields] == [getattr(cfg.model, f) for f in fields]
    assert (read.image_tokens, vision_params(read)) == (cfg.model.image_tokens, vision)


def _square(side: int):
    from PIL import Image

    return Image.new("RGB", (side, side), (200, 30, 30))


@pytest.mark.parametrize("side", [300, 512, 1000])
def test_smolvlm_image_tokens_are_the_processors(side):
    """SmolVLM's image processor (its hub settings) tiles a square picture of any size into 4 x 4 crops and a
    whole view; its prompt builder writes 64 image tokens a crop: the preset's 1,088."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    model = compose(["model=smolvlm2_500m"]).model
    images = SmolVLMImageProcessorPil(
        do_image_splitting=True, size={"longest_edge": 2048}, max_image_size={"longest_edge": 512}
    )(_square(side), return_row_col_info=True)
    per_crop = model.image_tokens // model.image_crops
    assert per_crop == 64  # the hub processor's image_seq_len
    assert images["pixel_values"].shape[1] == model.image_crops == 17
    prompt = get_image_prompt_string(
        images["rows"][0][0],
        images["cols"][0][0],
        per_crop,
        fake_token_around_image="<fake_token_around_image>",
        image_token="<image>",
        global_image_token="<global-img>",
    )
    assert prompt.count("<image>") == model.image_tokens == 1088


def test_gemma3_image_tokens_are_the_pooled_patches():
    """Gemma 3's image processor resizes any picture to 896 x 896: 64 x 64 patches of 14 pixels, pooled to the
    config's 256 (mm_tokens_per_image), which its processor writes as 256 image tokens."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    model = compose(["model=gemma3_12b_vision"]).model
    processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    pixels = processor(_square(500), return_tensors="pt")["pixel_values"]
    patches = (pixels.shape[-1] // model.patch_size) * (pixels.shape[-2] // model.patch_size)
    assert patches // model.vision_token_merge == model.image_tokens == GEMMA3_12B["mm_tokens_per_image"]


def test_qwen3_vl_image_tokens_are_the_processors():
    """Qwen3-VL's image processor (16-pixel patches, 2 x 2 merged) on a picture of model.image_size: its grid
    over the merge is the planned count."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = compose(["model=qwen3_vl_8b"]).model
    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)(
        _square(model.image_size)
    )
    assert int(images["image_grid_thw"].prod()) // 4 == model.image_tokens == 196


def _small(preset: str) -> dict:
    """The preset's hub config.json at a few dozen units a side: the same modules, built on the CPU in seconds."""
    small = json.loads(json.dumps(FAMILIES[preset][0]))
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=256, head_dim=16)
    small["text_config"].update(text, num_attention_heads=4, num_key_value_heads=2)
    vision = small["vision_config"]
    vision.update(hidden_size=32, intermediate_size=48)
    if preset == "qwen3_vl_8b":
        vision.update(depth=3, num_heads=2, out_hidden_size=64, deepstack_visual_indexes=[0, 2])
        vision.update(num_position_embeddings=16)
    else:
        vision.update(num_hidden_layers=2, num_attention_heads=2, image_size=64)
    if preset == "gemma3_12b_vision":
        small["mm_tokens_per_image"] = 4  # 56 / 14 is 4 patches a side: pooled 2 x 2
        vision.update(image_size=56)
    return small


@pytest.mark.parametrize("lora_vision", [False, True])
@pytest.mark.parametrize("preset", FAMILIES)
def test_lora_counts_are_pefts_on_a_small_model_of_the_family(tmp_path, preset, lora_vision):
    """LoRA as the trainer sets it up (finetune.modeling.loading.lora_config) on transformers' own class of a
    small config of the family: the trainable parameters are the plan's count. With `method.lora_vision`, the
    encoder's projections and the projector trained whole (Qwen3-VL: its merger, not the deepstack mergers,
    whose linears share the names); without, the language model's projections alone."""
    import dataclasses

    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.core.config import ModelConfig
    from finetune.modeling.loading import lora_config
    from finetune.modeling.resolve import model_from_hf_config

    hf = AutoConfig.from_pretrained(str(_write(tmp_path, _small(preset))))
    m = model_from_hf_config(ModelConfig(), hf, "test", name=f"small-{preset}")
    method = dataclasses.replace(MethodConfig(name="lora"), lora_vision=lora_vision)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == count_params(m).total
    adapted = get_peft_model(model, lora_config(method, m))
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert trainable == lora_params(m, method)
    assert (vision_lora_params(m, method) > 0) == lora_vision


def test_llama_32_vision_is_refused_naming_its_cross_attention(tmp_path):
    path = _write(tmp_path, {"model_type": "mllama", "architectures": ["MllamaForConditionalGeneration"]})
    proc = run_cli("mode=plan", f"model.config_path={path}", "hardware=h100", f"run_dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    assert "mllama is a vision-language family" in proc.stderr and "cross-attention layers" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_gemma3_text_preset_accepts_another_gemma3_checkpoint(tmp_path, monkeypatch):
    """model=gemma3_12b (the text decoder) given another Gemma 3 checkpoint of its shape (the hub's are
    image-text, model_type gemma3): checked against that checkpoint's text decoder, kept as the text preset."""
    import dataclasses

    from finetune.modeling import resolve

    monkeypatch.setattr(resolve, "hub_config_json", lambda hub_id: _write(tmp_path, GEMMA3_12B))
    text = dataclasses.replace(
        compose(["model=gemma3_12b"]).model, hub_id="google/gemma-3-12b-pt", shape="checked"
    )
    assert resolve.checked_against_hub(text) == text
    wider = dataclasses.replace(text, hidden_size=4096)
    with pytest.raises(ConfigError, match="hidden_size 3840 not 4096"):
        resolve.checked_against_hub(wider)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.image_crops=0", "model.image_crops=0 must be > 0"),
        ("model.vision_deepstack=-1", "model.vision_deepstack=-1 must be >= 0"),
        ("model.vision_positions=-4", "model.vision_positions=-4 must be >= 0"),
    ],
)
def test_bad_image_side_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        compose(["model=qwen3_vl_8b", override])
