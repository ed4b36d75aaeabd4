"""docker/: no Docker engine runs here, so check the Dockerfile's structure, its pins against pyproject.toml,
and that compose.yaml reserves the GPUs and mounts the cache and outputs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
MUST_PIN = ("torch", "transformers", "peft", "trl", "accelerate", "deepspeed", "bitsandbytes")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DOCKER / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for word, args in instructions():
        if word == "RUN" and "pip install" in args:
            for name, version in re.findall(r"(?<![\w-])([A-Za-z][\w.\-]*)==([\w.+]+)", args):
                found[canonicalize_name(name)] = Version(version)
    return found


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def test_dockerfile_structure():
    ins = instructions()
    froms = [args for word, args in ins if word == "FROM"]
    assert len(froms) == 1 and froms[0].startswith("nvidia/cuda:") and "cudnn-devel" in froms[0]
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    entry = [args for word, args in ins if word == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]) == ["python", "-m", "finetune"]
    runs = " ".join(args for word, args in ins if word == "RUN")
    assert "pip install ." in runs
    sources = {src for word, args in ins if word == "COPY" for src in args.split()[:-1]}
    assert {"pyproject.toml", "README.md", "finetune", "configs", "recipes"} <= sources
    # The project is installed before switching to the unprivileged user.
    order = [word for word, _ in ins]
    assert order.index("USER") > max(i for i, (w, a) in enumerate(ins) if w == "RUN" and "pip install ." in a)


def test_every_engine_package_is_pinned_within_pyproject():
    found, reqs = pins(), requirements()
    missing = [name for name in MUST_PIN if name not in found]
    assert not missing, f"not pinned in the Dockerfile: {missing}"
    for name, version in found.items():
        if name in reqs:
            assert reqs[name].specifier.contains(version, prereleases=True), (
                f"Dockerfile pins {name}=={version}, pyproject wants {reqs[name].specifier}"
            )


def test_pin_check_catches_a_bad_pin():
    reqs = requirements()
    assert not reqs["torch"].specifier.contains(Version("2.14.0"))
    assert not reqs["trl"].specifier.contains(Version("2.0.0"))


def test_compose_reserves_gpus_and_mounts_cache_and_outputs():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    svc = compose["services"]["finetune"]
    assert svc["build"]["dockerfile"] == "docker/Dockerfile" and svc["build"]["context"] == ".."
    [device] = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == "all" and device["capabilities"] == ["gpu"]
    assert svc.get("ipc") == "host" or "shm_size" in svc
    targets = {v.rsplit(":", 1)[1] for v in svc["volumes"]}
    assert {"/cache/huggingface", "/workspace/runs"} <= targets
    assert svc["environment"]["HF_HOME"] == "/cache/huggingface"
