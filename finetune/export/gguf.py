"""export.gguf: the merged model as a GGUF file for llama.cpp and Ollama, through llama.cpp's own converter.

llama.cpp's `convert_hf_to_gguf.py` (with its `conversion` package and its own `gguf-py`) ships on PyPI inside
llama-cpp-python's source release (vendor/llama.cpp). Unless `export.gguf_converter` names a llama.cpp
checkout, that release is fetched once with pip (`LLAMA_CPP_PYTHON`) and its converter kept in
$FINETUNE_CACHE/llama.cpp. The converter writes f16, bf16 and q8_0 itself; q4_k_m is llama.cpp's quantizer
(`llama_model_quantize`, from llama-cpp-python when it is installed) applied to the f16 file.

Written into export/gguf/: NAME.TYPE.gguf and an Ollama `Modelfile` (FROM the file, a TEMPLATE rendered from
the tokenizer's chat template, a PARAMETER stop per end token).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Optional

from finetune.core.config import Config
from finetune.core.errors import ConfigError
from finetune.export.merge import ExportError
from finetune.modeling import cache

# The llama-cpp-python source release whose vendored llama.cpp converts (pip download, no build).
LLAMA_CPP_PYTHON = "0.3.36"
CONVERTER = "convert_hf_to_gguf.py"
# What of the release's vendor/llama.cpp the converter needs.
_CONVERTER_PARTS = (CONVERTER, "LICENSE", "conversion/", "gguf-py/gguf/")
# The file types llama.cpp's converter writes itself; the others are quantized from its f16 file.
CONVERTER_TYPES = ("f16", "bf16", "q8_0")
# llama.cpp's quantizer's file types (llama_ftype), by export.gguf name.
QUANTIZER_TYPES = {"q4_k_m": 15}

# Pre-tokenizers llama.cpp implements, by their tokenizer.json description. llama.cpp's converter knows a
# tokenizer by the hash of its tokens for a test string, so a vocabulary trained anew (the tiny model's) is
# unknown to it even when its pre-tokenizer is one llama.cpp has: then this names it.
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {  # digits one per token, then GPT-2's byte-level split (SmolLM, SmolLM2, the tiny model)
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
}


def file_name(cfg: Config) -> str:
    """export/gguf/NAME.TYPE.gguf."""
    return f"{cfg.export.served_model_name or cfg.name}.{cfg.export.gguf}.gguf"


def converter_dir(cfg: Config) -> Path:
    """The folder holding llama.cpp's convert_hf_to_gguf.py: export.gguf_converter, or the cached copy of the
    one llama-cpp-python's source release vendors (fetched with pip on first use). One line when neither is
    there, before anything is converted."""
    if cfg.export.gguf_converter:
        folder = Path(cfg.export.gguf_converter).expanduser()
        if not (folder / CONVERTER).is_file():
            raise ConfigError(f"export.gguf_converter={folder}: no {CONVERTER} there (a llama.cpp checkout)")
        return folder
    target = cache.root() / "llama.cpp" / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    return cache.build_once(target, _fetch_converter)


def _fetch_converter(out: Path) -> None:
    """llama.cpp's converter, its `conversion` package and gguf-py out of llama-cpp-python's source release."""
    with tempfile.TemporaryDirectory() as download:
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--dest", download]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True)
        sdists = list(Path(download).glob("*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            said = (proc.stderr.strip().splitlines() or ["no source release"])[-1]
            raise ExportError(
                f"export.gguf: llama.cpp's converter is not cached and pip could not fetch llama-cpp-python=="
                f"{LLAMA_CPP_PYTHON}'s source release ({said}); nothing was exported. Set "
                "export.gguf_converter=PATH to a llama.cpp checkout, or run once where PyPI is reachable"
            )
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                rel = member.name[len(prefix) :] if member.name.startswith(prefix) else ""
                if member.isfile() and rel.startswith(_CONVERTER_PARTS):
                    member.name = rel
                    tar.extract(member, out, filter="data")
    if not (out / CONVERTER).is_file():
        raise ExportError(f"llama-cpp-python=={LLAMA_CPP_PYTHON}'s source release holds no {CONVERTER}")


def quantizer() -> Any:
    """llama-cpp-python's bindings (llama.cpp's quantizer), or None when it is not installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    return llama_cpp


def check_ready(cfg: Config, merges: bool) -> Optional[Path]:
    """Before the export writes anything: the converter (fetched if needed) and, for q4_k_m, the quantizer.
    Returns the converter's folder; None without export.gguf."""
    gguf_type = cfg.export.gguf
    if gguf_type is None:
        return None
    if not merges:
        raise ConfigError("export.gguf converts the merged model: it needs export.merge=true")
    if importlib.util.find_spec("sentencepiece") is None:
        raise ConfigError(
            "export.gguf needs sentencepiece (llama.cpp's converter imports it): pip install 'finetune[gguf]'"
        )
    if gguf_type in QUANTIZER_TYPES and quantizer() is None:
        raise ConfigError(
            f"export.gguf={gguf_type} needs llama.cpp's quantizer: pip install llama-cpp-python (it builds "
            f"llama.cpp); export.gguf={' or '.join(CONVERTER_TYPES)} needs only the converter"
        )
    return converter_dir(cfg)


def pre_tokenizer(model_dir: Path) -> str:
    """llama.cpp's name for the model's pre-tokenizer when PRE_TOKENIZERS knows its description, else ""
    (llama.cpp's converter then recognises the tokenizer itself, or says it cannot)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return ""
    described = json.loads(path.read_text()).get("pre_tokenizer")
    return next((name for name, known in PRE_TOKENIZERS.items() if known == described), "")


def convert(cfg: Config, converter: Path, model_dir: Path, out_dir: Path) -> dict[str, Any]:
    """export/gguf/NAME.TYPE.gguf from the merged model folder; what was written."""
    gguf_type = str(cfg.export.gguf)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / file_name(cfg)
    first = gguf_type if gguf_type in CONVERTER_TYPES else "f16"
    converted = target if first == gguf_type else out_dir / f".{target.stem}.f16.gguf"
    runner = Path(__file__).with_name("llama_convert.py")
    argv = [sys.executable, str(runner), str(converter), pre_tokenizer(model_dir), str(model_dir),
            "--outfile", str(converted), "--outtype", first]  # fmt: skip
    # The converter with its own gguf-py (NO_LOCAL_GGUF would make it use the installed gguf package instead).
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=cfg.export.gguf_timeout_s
        )
    except subprocess.TimeoutExpired:
        converted.unlink(missing_ok=True)
        raise ExportError(
            f"llama.cpp's converter ran past export.gguf_timeout_s={cfg.export.gguf_timeout_s:g} s and was "
            "stopped; nothing was exported"
        ) from None
    if proc.returncode != 0 or not converted.is_file():
        said = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
        raise ExportError(f"llama.cpp's converter failed ({' | '.join(said)}); nothing was exported")
    if converted != target:
        _quantize(converted, target, QUANTIZER_TYPES[gguf_type])
        converted.unlink()
    return {"path": target.name, "type": gguf_type, "size_bytes": target.stat().st_size,
            "converter": f"llama.cpp {CONVERTER}" + (f" + llama_model_quantize ({gguf_type})" if first != gguf_type else "")}  # fmt: skip


def _quantize(source: Path, target: Path, ftype: int) -> None:
    llama_cpp = quantizer()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params)
    if code != 0:
        raise ExportError(
            f"llama.cpp's quantizer failed on {source.name} (code {code}); nothing was exported"
        )


SENTINEL = "\u2063FINETUNE\u2063"


def _render(tokenizer: Any, messages: list[dict[str, str]], prompt: bool = False) -> Optional[str]:
    try:
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))
    except Exception:  # a template that refuses a conversation of this shape (a system turn alone, say)
        return None


def ollama_template(tokenizer: Any) -> tuple[str, list[str]]:
    """The chat template as Ollama's Go template, and the stop strings: each role's text before and after its
    content, found by rendering the tokenizer's own template around a placeholder; the BOS token is left to
    llama.cpp (the GGUF file says whether to add it)."""
    bos = tokenizer.bos_token or ""
    parts: dict[str, tuple[str, str]] = {}
    for role in ("system", "user", "assistant"):
        text = _render(tokenizer, [{"role": role, "content": SENTINEL}])
        if text is None or SENTINEL not in text:
            continue
        before, after = text.split(SENTINEL, 1)
        parts[role] = (before[len(bos) :] if bos and before.startswith(bos) else before, after)
    empty = _render(tokenizer, [{"role": "user", "content": SENTINEL}]) or ""
    prompted = _render(tokenizer, [{"role": "user", "content": SENTINEL}], prompt=True) or ""
    generation = prompted[len(empty) :] if prompted.startswith(empty) else ""
    branches = [
        f'{"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{_go(before)}{{{{ .Content }}}}{_go(after)}'
        for i, (role, (before, after)) in enumerate(parts.items())
    ]
    template = (
        "{{- range .Messages }}{{ " + "{{ ".join(branches) + "{{ end }}{{ end }}" + _go(generation)
        if branches
        else "{{ .Prompt }}"
    )
    stops = [t for t in dict.fromkeys([tokenizer.eos_token, *_end_tokens(tokenizer, parts)]) if t]
    return template, stops


def _end_tokens(tokenizer: Any, parts: dict[str, tuple[str, str]]) -> list[str]:
    """The special tokens that close an assistant turn (its text after the content)."""
    after = parts.get("assistant", ("", ""))[1]
    return [t for t in tokenizer.all_special_tokens if t and t in after]


def _go(text: str) -> str:
    """Literal text inside a Go template (its delimiters escaped)."""
    return text.replace("{{", '{{ "{{" }}')


def modelfile(tokenizer: Any, gguf_name: str) -> str:
    """The Ollama Modelfile for the GGUF file beside it."""
    template, stops = ollama_template(tokenizer)
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    return "\n".join(lines) + "\n"
