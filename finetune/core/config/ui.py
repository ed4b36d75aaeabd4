"""Schema of the `ui` config group: `python -m finetune mode=ui`, the planner and the runs as a local web page."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.core.errors import ConfigError

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class UiConfig:
    """Where the page is served and what it shows first."""

    # The address the server binds: loopback unless asked (another address is reachable from the network).
    host: str = "127.0.0.1"
    # 0: a free port, printed at start.
    port: int = 8765
    # The run directories the runs pages list, read-only.
    runs_dir: str = "runs"
    # The recipe the plan page opens on when its address names no settings.
    recipe: str = "llama8b_lora"

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError("ui.host: empty; 127.0.0.1 serves this machine only")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ui.port={self.port} must be in [0, 65535] (0: a free port)")
        if not self.runs_dir.strip():
            raise ConfigError("ui.runs_dir: empty; name the folder that holds the run directories")

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK
