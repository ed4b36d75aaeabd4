"""export/README.md, the Hub model card, and export.push_to_hub's refusal where the Hub cannot be reached."""

from __future__ import annotations

import json
import re
import socket
from dataclasses import asdict, replace

import pytest
import yaml
from helpers import child_env, planned, run_cli

from finetune.core.composition import compose
from finetune.core.errors import ConfigError
from finetune.export import modelcard


def flat(cfg) -> dict:
    out = modelcard.flatten(asdict(cfg))
    return {k: v for k, v in out.items() if not k.startswith("hardware.") and k not in ("mode", "run_dir")}


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.max_steps=4", "train.report_to=[mlflow,wandb]", "export.gguf=q8_0", "eval.regression=false"],
        ["model=llama3_1_8b", "method=qlora", "hardware=h100", "method.lora_rank=32", "data.path=org/chats",
         "data.system_prompt='Be brief, kind: always.'", "export.push_to_hub=me/llama-qlora"],
    ],
)  # fmt: skip
def test_reproduce_command_composes_the_same_config(overrides):
    cfg = compose([*overrides, "mode=plan"])
    again = modelcard.reproduce_overrides(cfg)
    assert flat(compose(again)) == flat(cfg), again
    assert len(again) <= len(overrides) + 2  # the recipe or model, the hardware: nothing else added


def test_card_front_matter_data_plan_and_scores(tmp_path):
    cfg, plan = planned("export.gguf=q8_0")
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps(plan.to_dict()))
    stats = {
        "num_train": 2700,
        "num_eval": 300,
        "seq_len": 128,
        "tokens": {"train_total": 64938, "p50": 22, "max": 44},
    }
    (run / "data_stats.json").write_text(json.dumps(stats))
    scores = {"base": {"loss": 6.9, "exact_match": 0.0}, "trained": {"loss": 0.52, "exact_match": 0.75},
              "merged": {"loss": 0.52, "exact_match": 0.75}}  # fmt: skip
    (run / "eval" / "metrics.json").write_text(json.dumps(scores))
    summary = {"merged": {}, "adapter": {}, "gguf": {"path": "tiny.q8_0.gguf", "type": "q8_0"}}
    card = modelcard.render(cfg, run, summary, "apache-2.0")

    front = yaml.safe_load(re.match(r"---\n(.*?)\n---\n", card, re.S).group(1))
    assert front == {"base_model": "tiny", "library_name": "transformers", "tags": ["finetune", "lora", "sft", "gguf"],
                     "license": "apache-2.0"}  # fmt: skip
    assert "| 2700 / 300 | 64938 | 22 / 44 | 128 |" in card
    assert f"- parameters: {plan.params_total:,} ({plan.params_trainable:,} trained)" in card
    assert f"micro_batch_size={plan.strategy.micro_batch_size}" in card
    assert "| model | loss | exact_match |" in card
    assert "| base | 6.9000 | 0.0000 |" in card and "| merged | 0.5200 | 0.7500 |" in card
    assert "`gguf/tiny.q8_0.gguf` (q8_0, llama.cpp) and `gguf/Modelfile`" in card
    command = card.split("```bash\n")[1].split("\n```")[0]
    assert command == "python -m finetune +recipe=tiny hardware=cpu export.gguf=q8_0"


def test_license_is_read_from_the_base_models_readme(tmp_path, tiny_model_cfg):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    model = replace(tiny_model_cfg, name="mine", config_path=str(folder / "config.json"))
    assert modelcard.base_license(model) is None
    (folder / "README.md").write_text("---\nlicense: llama3.1\nlanguage: [en]\n---\n# Base\n")
    assert modelcard.base_license(model) == "llama3.1"


def test_push_to_hub_is_a_repository_id():
    with pytest.raises(
        ConfigError, match=r"export.push_to_hub='nope' must be a Hub repository id \(org/name\)"
    ):
        compose(["export.push_to_hub=nope", "mode=plan"])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "env, said",
    [
        ({"HF_HUB_OFFLINE": "1"}, r"the Hub is offline here \(HF_HUB_OFFLINE=1\); nothing was exported or uploaded"),
        ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:{port}", "HF_TOKEN": "hf_not_a_real_token_0123"},
         r"cannot reach the Hub as a signed-in user \(.*\); nothing was exported or uploaded"),
    ],
)  # fmt: skip
def test_push_to_hub_stops_in_one_line_before_anything(tmp_path, env, said):
    """Offline or unreachable: `mode=all export.push_to_hub=...` stops before the data stage, in one line,
    exit 2; the run directory holds no data, model or export."""
    run = tmp_path / "run"
    env = {k: v.format(port=closed_port()) for k, v in env.items()}
    proc = run_cli(f"run_dir={run}", "export.push_to_hub=me/tiny", env=child_env(**env), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert re.search(rf"export.push_to_hub=me/tiny: {said}", lines[-1]), lines[-3:]
    assert not any((run / name).exists() for name in ("data", "adapter", "export", "plan.json"))


def test_upload_is_one_commit_of_export(tmp_path, monkeypatch):
    """What export.push_to_hub sends: the merged model at the repository's root, the card, gguf/ and adapter/,
    in one commit to a private repository (huggingface_hub's HfApi, recorded here instead of the network)."""
    import huggingface_hub

    from finetune.export import hub

    export = tmp_path / "export"
    for name in ("merged/config.json", "merged/model.safetensors", "README.md", "gguf/tiny.q8_0.gguf",
                 "gguf/Modelfile", "adapter/adapter_config.json", "serve.sh", "merge_check.json"):  # fmt: skip
        (export / name).parent.mkdir(parents=True, exist_ok=True)
        (export / name).write_text(name)
    calls = []

    class Api:
        def create_repo(self, repo, private, exist_ok):
            calls.append(("create_repo", repo, private, exist_ok))
            return f"https://hub.example/{repo}"

        def create_commit(self, repo, operations, commit_message):
            calls.append(
                ("create_commit", repo, sorted(op.path_in_repo for op in operations), commit_message)
            )
            return type("Commit", (), {"oid": "abc123"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    cfg = compose(["export.push_to_hub=me/tiny-lora", "mode=plan"])
    done = hub.upload(cfg, export)
    assert calls == [
        ("create_repo", "me/tiny-lora", True, True),
        ("create_commit", "me/tiny-lora", ["README.md", "adapter/adapter_config.json", "config.json",
                                           "gguf/Modelfile", "gguf/tiny.q8_0.gguf", "model.safetensors"],
         f"finetune: {cfg.name}"),
    ]  # fmt: skip
    assert done == {
        "repo": "me/tiny-lora",
        "url": "https://hub.example/me/tiny-lora",
        "commit": "abc123",
        "files": 6,
    }
