"""export.gguf: llama.cpp's own converter writes the model as GGUF; the file read back with the gguf reader (and
run with llama-cpp-python where it is installed); the Ollama Modelfile from the chat template."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import tiny_cfg

from finetune.core.errors import ConfigError
from finetune.export import gguf


@pytest.fixture(scope="module")
def converter(tiny_cache) -> Path:
    """llama.cpp's converter, fetched once (pip download of llama-cpp-python's source release) into the cache."""
    return gguf.converter_dir(tiny_cfg("export.gguf=f16"))


def gguf_fields(path: Path) -> tuple[dict, list]:
    """(metadata by key, tensors) of a GGUF file, through the gguf package's reader."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}, list(reader.tensors)


def test_gguf_settings_are_checked_before_anything_is_written(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"export.gguf='q2' is not one of f16, bf16, q8_0, q4_k_m"):
        tiny_cfg("export.gguf=q2")
    with pytest.raises(
        ConfigError, match=r"export.gguf converts the merged model: it needs export.merge=true"
    ):
        gguf.check_ready(tiny_cfg("export.gguf=q8_0", "export.merge=false"), merges=False)
    real = gguf.importlib.util.find_spec
    monkeypatch.setattr(
        gguf.importlib.util, "find_spec", lambda name: None if name == "sentencepiece" else real(name)
    )
    with pytest.raises(
        ConfigError, match=r"export.gguf needs sentencepiece .*: pip install 'finetune\[gguf\]'"
    ):
        gguf.check_ready(tiny_cfg("export.gguf=q8_0"), merges=True)
    monkeypatch.setattr(gguf.importlib.util, "find_spec", real)
    monkeypatch.setattr(gguf, "quantizer", lambda: None)
    with pytest.raises(ConfigError, match=r"export.gguf=q4_k_m needs llama.cpp's quantizer: pip install"):
        gguf.check_ready(tiny_cfg("export.gguf=q4_k_m"), merges=True)
    with pytest.raises(ConfigError, match=r"export.gguf_converter=.*nope: no convert_hf_to_gguf.py there"):
        gguf.converter_dir(tiny_cfg("export.gguf=f16", f"export.gguf_converter={tmp_path / 'nope'}"))


def test_modelfile_renders_the_chat_template_for_ollama(tiny_tokenizer):
    text = gguf.modelfile(tiny_tokenizer, "tiny.q8_0.gguf")
    assert text == (
        "FROM ./tiny.q8_0.gguf\n"
        'TEMPLATE """{{- range .Messages }}'
        '{{ if eq .Role "system" }}<|system|>\n{{ .Content }}<|end|>\n'
        '{{ else if eq .Role "user" }}<|user|>\n{{ .Content }}<|end|>\n'
        '{{ else if eq .Role "assistant" }}<|assistant|>\n{{ .Content }}<|end|>\n'
        '{{ end }}{{ end }}<|assistant|>\n"""\n'
        'PARAMETER stop "<|end|>"\n'
    )


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_converter_writes_the_model_and_its_template(
    tmp_path, tiny_model_dir, tiny_tokenizer, converter, gguf_type
):
    """The tiny model through llama.cpp's converter: every tensor of the safetensors file is in the GGUF file,
    with the model's shape, its tokenizer (llama.cpp's `smollm` pre-tokenizer: digits one by one, then
    byte-level) and the chat template as transformers has it; the weights of the asked type."""
    from gguf import GGMLQuantizationType
    from safetensors import safe_open

    cfg = tiny_cfg(f"export.gguf={gguf_type}")
    written = gguf.convert(cfg, converter, tiny_model_dir, tmp_path / "gguf")
    path = tmp_path / "gguf" / written["path"]
    assert written["path"] == f"{cfg.name}.{gguf_type}.gguf" and written["size_bytes"] == path.stat().st_size
    meta, tensors = gguf_fields(path)
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert len(tensors) == len(names)
    m = cfg.model
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.block_count"], meta["llama.embedding_length"]) == (m.num_layers, m.hidden_size)
    assert (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]) == (
        m.num_heads,
        m.num_kv_heads,
    )
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert len(meta["tokenizer.ggml.tokens"]) == m.vocab_size
    assert meta["tokenizer.chat_template"] == tiny_tokenizer.chat_template
    assert meta["tokenizer.ggml.eos_token_id"] == tiny_tokenizer.eos_token_id
    matrices = {t.tensor_type for t in tensors if len(t.shape) == 2 and t.name != "token_embd.weight"}
    expected = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0}[gguf_type]
    assert matrices == {expected}, matrices


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", ["f16", "q8_0"])
def test_llama_cpp_answers_as_the_model_does(tmp_path, tiny_model_dir, tiny_tokenizer, converter, gguf_type):
    """The GGUF file run by llama.cpp (llama-cpp-python) answers a prompt greedily with the tokens transformers'
    model answers."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp)")
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    cfg = tiny_cfg(f"export.gguf={gguf_type}")
    path = tmp_path / gguf.convert(cfg, converter, tiny_model_dir, tmp_path)["path"]
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    text = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = out[0, len(prompt) :].tolist()
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False)
    answer = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        answer.append(int(token))
        if len(answer) == len(expected):
            break
    assert answer == expected, (tiny_tokenizer.decode(answer), tiny_tokenizer.decode(expected))


@pytest.mark.slow
def test_q4_k_m_is_quantized_by_llama_cpp(tmp_path, tiny_model_dir, converter):
    """export.gguf=q4_k_m: the converter's f16 file through llama.cpp's quantizer; the file says Q4_K_M
    (llama_ftype 15), holds every tensor and is smaller than the f16 one, which is not kept."""
    if gguf.quantizer() is None:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp)")
    written = gguf.convert(tiny_cfg("export.gguf=q4_k_m"), converter, tiny_model_dir, tmp_path / "q4")
    f16 = gguf.convert(tiny_cfg("export.gguf=f16"), converter, tiny_model_dir, tmp_path / "f16")
    meta, tensors = gguf_fields(tmp_path / "q4" / written["path"])
    _, f16_tensors = gguf_fields(tmp_path / "f16" / f16["path"])
    assert meta["general.file_type"] == 15 and len(tensors) == len(f16_tensors)
    assert written["size_bytes"] < f16["size_bytes"]
    assert sorted(p.name for p in (tmp_path / "q4").iterdir()) == [written["path"]]


def test_a_converter_that_hangs_is_stopped_at_its_timeout_and_nothing_is_exported(tmp_path):
    """A user's llama.cpp checkout runs as its own process under export.gguf_timeout_s: past it the process is
    stopped, the partial file removed, and the export fails in one line."""
    from finetune.export.merge import ExportError

    fake = tmp_path / "llama.cpp"
    fake.mkdir()
    (fake / "convert_hf_to_gguf.py").write_text("import time\ntime.sleep(60)\n")
    cfg = tiny_cfg("export.gguf=f16", f"export.gguf_converter={fake}", "export.gguf_timeout_s=1")
    out = tmp_path / "gguf"
    with pytest.raises(ExportError) as err:
        gguf.convert(cfg, fake, tmp_path, out)
    assert str(err.value) == (
        "llama.cpp's converter ran past export.gguf_timeout_s=1 s and was stopped; nothing was exported"
    )
    assert list(out.iterdir()) == []
    for bad in ("0", "-5", "inf", "nan"):
        with pytest.raises(ConfigError, match=rf"export.gguf_timeout_s={bad}.* must be a finite number"):
            tiny_cfg(f"export.gguf_timeout_s={bad}")
