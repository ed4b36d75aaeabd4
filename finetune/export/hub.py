"""export.push_to_hub=org/name: export/ uploaded to the Hugging Face Hub in one commit, through huggingface_hub.

The Hub is asked first, before the export merges or writes anything (`check_reachable`): offline
(HF_HUB_OFFLINE=1), without a token or unreachable, the export stops in one line and nothing is uploaded.
The upload is one commit (the merged model at the repository's root, README.md, gguf/, adapter/), so the
repository never holds half of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.core.config import Config
from finetune.core.errors import ConfigError
from finetune.rundir.layout import EXPORT_ADAPTER_DIR, EXPORT_GGUF_DIR, MERGED_DIR, MODEL_CARD_FILE


def check_reachable(cfg: Config) -> None:
    """One line, before anything is exported, when export.push_to_hub cannot upload from here."""
    repo = cfg.export.push_to_hub
    if not repo:
        return
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"export.push_to_hub={repo}: the Hub is offline here (HF_HUB_OFFLINE=1); nothing was exported or "
            "uploaded (unset it, or leave export.push_to_hub out)"
        )
    try:
        HfApi().whoami()
    except Exception as exc:  # no token, a refused one, or no network: each is one line
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"export.push_to_hub={repo}: cannot reach the Hub as a signed-in user ({said}); nothing was "
            "exported or uploaded (hf auth login, or HF_TOKEN)"
        ) from None


def files(export_dir: Path) -> list[tuple[str, Path]]:
    """(path in the repository, file): the merged model at the root, the card, the GGUF folder, the adapter."""
    export_dir = Path(export_dir)
    out: list[tuple[str, Path]] = []
    merged = export_dir / MERGED_DIR
    if merged.is_dir():
        out += [
            (p.relative_to(merged).as_posix(), p)
            for p in sorted(merged.rglob("*"))
            if p.is_file() and p.relative_to(merged).as_posix() != MODEL_CARD_FILE  # the card is export/'s
        ]
    card = export_dir / MODEL_CARD_FILE
    if card.is_file():
        out.append((MODEL_CARD_FILE, card))
    for folder in (EXPORT_GGUF_DIR, EXPORT_ADAPTER_DIR):
        root = export_dir / folder
        if root.is_dir():
            out += [(p.relative_to(export_dir).as_posix(), p) for p in sorted(root.rglob("*")) if p.is_file()]
    return out


def upload(cfg: Config, export_dir: Path) -> dict[str, Any]:
    """export/ to the Hub repository export.push_to_hub (created if needed, private unless hub_private=false)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    repo = str(cfg.export.push_to_hub)
    api = HfApi()
    url = api.create_repo(repo, private=cfg.export.hub_private, exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for name, path in files(export_dir)
    ]
    commit = api.create_commit(repo, operations=operations, commit_message=f"finetune: {cfg.name}")
    return {"repo": repo, "url": str(url), "commit": commit.oid, "files": len(operations)}
