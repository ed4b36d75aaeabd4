"""The import contract (ARCHITECTURE.md): layers that only point down, no cycles, imports at module level.

    python -m pytest tests/test_architecture.py -q

Read from the source with `ast`, so nothing is imported to check it:

- every module under finetune/ belongs to one layer of `LAYERS` (a new module must be placed);
- a module-level import of a project module never points to a higher layer; among the stages, a
  package imports only the ones below it (`STAGE_ORDER`: data < evaluation, train < export): training
  trains and the eval stage scores, so neither imports the other;
- the module-level import graph has no cycle;
- project modules are imported at module level; `EXCEPTIONS` names the few imported inside a
  function, each with its reason;
- `python -m finetune mode=plan` (and a launch dry run) loads none of the heavy libraries;
- no module under tests/ imports a test module: what tests share lives in tests/helpers.py (and the
  fixtures in tests/conftest.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "finetune"

# Bottom to top: a folder is a layer. A module may import its own layer and the ones below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core: errors, config schemas, Hydra composition, pure facts", ("finetune.core", "finetune.core.*")),
    ("planner (pure)", ("finetune.planner", "finetune.planner.*")),
    (
        "run directory and models",
        ("finetune.rundir", "finetune.rundir.*", "finetune.modeling", "finetune.modeling.*"),
    ),
    (
        "stages",
        (
            "finetune.data",
            "finetune.data.*",
            "finetune.evaluation",
            "finetune.evaluation.*",
            "finetune.train",
            "finetune.train.*",
            "finetune.export",
            "finetune.export.*",
        ),
    ),
    ("launch", ("finetune.launch", "finetune.launch.*")),
    (
        "pipeline and command line",
        (
            "finetune",
            "finetune.__main__",
            "finetune.pipeline",
            "finetune.pipeline.*",
            "finetune.ui",
            "finetune.ui.*",
        ),
    ),
]

# Among the stages: a package imports only packages of a lower rank. Everything reads the data stage's
# output; export scores the merged model through the eval stage; training and evaluation are siblings (the
# worker trains, the eval stage scores base, trained and merged), so train/ never imports evaluation/.
STAGE_ORDER = {"data": 0, "evaluation": 1, "train": 1, "export": 2}

# (importer, imported) across sibling stages, each with its reason.
STAGE_CROSSINGS: dict[tuple[str, str], str] = {}

# (importer, imported): why the import sits inside a function.
EXCEPTIONS = {
    ("finetune.pipeline.stages", "finetune.evaluation.stage"): "the evaluation and export stages load torch, "
    "transformers and PEFT on import (the chunked loss and the collator are torch modules); the pipeline "
    "imports them when it runs them, so mode=plan, data and launch load none of them",
    ("finetune.pipeline.stages", "finetune.export.stage"): "as finetune.evaluation.stage",
    ("finetune.pipeline.cli", "finetune.evaluation.chat"): "as finetune.evaluation.stage: mode=chat loads "
    "torch and transformers, every other mode's command line must not",
    ("finetune.train.__main__", "finetune.train.stage"): "the worker installs its signal handlers before it "
    "imports torch, transformers and TRL (seconds), so a signal during that import also exits 75 with one line",
    ("finetune.train.__main__", "finetune.train.resume"): "as finetune.train.stage",
}

HEAVY = ("torch", "transformers", "trl", "peft", "deepspeed", "datasets", "bitsandbytes", "accelerate")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = all_modules()


def layer_of(module: str) -> int:
    for i, (_, names) in enumerate(LAYERS):
        if module in names:
            return i
    for i, (_, names) in enumerate(LAYERS):
        if any("*" in n and fnmatch(module, n) for n in names):
            return i
    raise KeyError(module)


def _resolve(node: ast.ImportFrom | ast.Import, module: str, is_package: bool) -> list[str]:
    """The project modules an import statement loads (`from finetune.data import stage` -> finetune.data.stage)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "finetune"]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    if base.split(".")[0] != "finetune":
        return []
    submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    # `from finetune.data import stage` loads finetune.data.stage (the package's __init__ comes with any
    # of its modules); names defined by the package itself are an import of its __init__.
    return submodules if len(submodules) == len(node.names) else [base, *submodules]


def imports(module: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(module-level, function-local) project imports of `module`, as (imported module, line)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    local_nodes = {
        id(n)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for n in ast.walk(fn)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    top, local = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _resolve(node, module, path.name == "__init__.py"):
                (local if id(node) in local_nodes else top).append((target, node.lineno))
    return top, local


def _stage_package(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in STAGE_ORDER and layer_of(module) == 3:
        return parts[1]
    return None


def test_every_module_has_a_layer():
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"place these modules in a layer of LAYERS (tests/test_architecture.py): {unplaced}"


def test_imports_only_point_down():
    upward = []
    crossed: set[tuple[str, str]] = set()
    for module in MODULES:
        for target, line in imports(module)[0] + imports(module)[1]:
            if target not in MODULES:
                continue
            if layer_of(target) > layer_of(module):
                upward.append(
                    f"{module}:{line} imports {target} ({LAYERS[layer_of(target)][0]} is above "
                    f"{LAYERS[layer_of(module)][0]})"
                )
                continue
            here, there = _stage_package(module), _stage_package(target)
            if here and there and here != there and STAGE_ORDER[there] >= STAGE_ORDER[here]:
                if (module, target) in STAGE_CROSSINGS:
                    crossed.add((module, target))
                    continue
                upward.append(f"{module}:{line} imports {target} (stage {there} is not below stage {here})")
    assert not upward, "\n".join(upward)
    assert crossed == set(STAGE_CROSSINGS), f"stale STAGE_CROSSINGS: {set(STAGE_CROSSINGS) - crossed}"


def test_no_import_cycle():
    graph = {m: sorted({t for t, _ in imports(m)[0] if t in MODULES and t != m}) for m in MODULES}
    # A module's import also runs its packages' __init__: those edges are the package's, not cycles.
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if node.startswith(nxt + "."):
                continue  # a module importing its own package's __init__
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_project_modules_are_imported_at_module_level():
    found = set()
    for module in MODULES:
        for target, line in imports(module)[1]:
            found.add((module, target))
            assert (module, target) in EXCEPTIONS, (
                f"{module}:{line} imports {target} inside a function: import it at module level "
                "(or add it to EXCEPTIONS with the reason)"
            )
    assert found == set(EXCEPTIONS), f"stale EXCEPTIONS: {set(EXCEPTIONS) - found}"


def test_the_contract_catches_what_it_forbids(tmp_path, monkeypatch):
    """The checks above would fail on an upward import, a cycle and a function-local import."""
    assert (
        layer_of("finetune.planner.search") < layer_of("finetune.rundir") < layer_of("finetune.train.stage")
    )
    assert (
        layer_of("finetune.train.stage")
        < layer_of("finetune.launch.engines")
        < layer_of("finetune.pipeline.cli")
    )
    src = (
        "from finetune.launch import engines\n"  # stages -> launch: upward
        "from finetune.evaluation import heldout\n"  # train -> evaluation: a sibling stage
        "def f():\n    from finetune import rundir\n"  # function-local
    )
    fake = PACKAGE / "train" / "_contract_probe.py"
    monkeypatch.setitem(MODULES, "finetune.train._contract_probe", fake)
    real_read = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda self, *a, **k: src if self == fake else real_read(self, *a, **k)
    )
    top, local = imports("finetune.train._contract_probe")
    assert ("finetune.launch.engines", 1) in top and ("finetune.rundir", 4) in local
    with pytest.raises(AssertionError, match="launch.engines"):
        test_imports_only_point_down()
    with pytest.raises(AssertionError, match="stage evaluation is not below stage train"):
        test_imports_only_point_down()
    with pytest.raises(AssertionError, match="inside a function"):
        test_project_modules_are_imported_at_module_level()


@pytest.mark.parametrize(
    "args",
    [
        ["+recipe=llama70b_lora", "mode=plan"],
        ["+recipe=llama70b_qlora", "mode=plan", "hardware=auto", "train.dataset_tokens=100000000"],
        ["+recipe=llama70b_full", "mode=launch", "launch.dry_run=true"],
    ],
    ids=["plan", "plan_auto", "launch_dry_run"],
)
def test_plan_and_dry_run_load_no_heavy_library(tmp_path, args):
    """`python -m finetune mode=plan` in a fresh process: the planner and the pipeline import no torch."""
    argv = [*args, f"run_dir={tmp_path / 'run'}"]
    code = (
        "import sys\n"
        "from finetune.pipeline.cli import main\n"
        f"code = main({argv!r})\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert code == 0, code\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "plan.json").is_file()


# ---------------------------------------------------------------- the tests: one helpers module, no test imports another

TESTS = REPO / "tests"


def imported_test_modules(source: str) -> list[tuple[str, int]]:
    """The test modules (tests.*, test_*, conftest, or relative) that `source` imports, anywhere in it,
    as (module, line); an import through a sys.path trick is still an import of `test_*`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if name.startswith(".") or top in ("tests", "conftest") or top.startswith("test_"):
                found.append((name, node.lineno))
    return sorted(found, key=lambda item: item[1])


def test_no_test_module_imports_another():
    """A test module imported by another runs again under a second name and ties the two files' setups
    together; what tests share belongs in tests/helpers.py."""
    found = {p.name: imported_test_modules(p.read_text()) for p in sorted(TESTS.glob("*.py"))}
    assert "helpers.py" in found and "test_architecture.py" in found
    offenders = {name: modules for name, modules in found.items() if modules}
    assert not offenders, f"move what these import into tests/helpers.py: {offenders}"


def test_the_test_import_check_catches_what_it_forbids():
    src = (
        "import json\n"
        "from helpers import tiny_cfg\n"
        "from tests.test_launch import planned\n"
        "import test_resume\n"
        "def f():\n"
        "    from test_eval import answer_length\n"
        "    from tests import test_bf16\n"
        "    from . import test_train\n"
    )
    assert imported_test_modules(src) == [
        ("tests.test_launch", 3),
        ("test_resume", 4),
        ("test_eval", 6),
        ("tests", 7),
        (".", 8),
    ]
