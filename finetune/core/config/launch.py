"""`launch`: how the plan is started (torchrun or accelerate, one node or several, SLURM), not what it trains.

The engine settings (ZeRO-3, FSDP2, offload, batch sizes) come from the plan;
these fields only say where the processes run and how they find each other.
`None` means: taken from the plan's hardware (GPUs per node, nodes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from finetune.core.config.checks import check_choices, check_positive, choice
from finetune.core.errors import ConfigError

LAUNCHERS = ("torchrun", "accelerate")
SCHEDULERS = ("none", "slurm")
RDZV_BACKENDS = ("c10d", "static")


@dataclass
class LaunchConfig:
    """`python -m finetune ... mode=launch launch.dry_run=true` prints the commands and writes launch.sh."""

    # accelerate: accelerate launch --config_file RUN_DIR/accelerate*.yaml.
    launcher: str = choice("torchrun", LAUNCHERS)
    # Processes per node and nodes; None: the plan's hardware (gpus_per_node, nodes).
    nproc_per_node: Optional[int] = None
    nnodes: Optional[int] = None
    node_rank: int = 0
    # Rendezvous (several nodes): node 0's address, reachable from every node.
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    rdzv_backend: str = choice("c10d", RDZV_BACKENDS)
    rdzv_id: Optional[str] = None  # default: the run's name
    # Nodes other than 0 wait this long for node 0's rendezvous port before giving up with a LaunchError.
    rdzv_wait_s: float = 120.0
    max_restarts: int = 0
    # Print the commands and write launch.sh (or slurm.sbatch), run nothing.
    dry_run: bool = False
    # Start although this machine does not match the plan (too few or too small GPUs, no CUDA, no bf16);
    # the mismatch is logged in metrics.json.
    allow_mismatch: bool = False
    # Start in tmux (nohup when tmux is absent) so the job survives a dropped SSH session.
    detach: bool = False
    session: Optional[str] = None  # tmux session name; default ft-<run name>
    # The interpreter whose torchrun/accelerate run the ranks; None: this one (sys.executable).
    python: Optional[str] = None
    scheduler: str = choice("none", SCHEDULERS)
    slurm_partition: Optional[str] = None
    slurm_account: Optional[str] = None
    slurm_time: str = "24:00:00"
    slurm_cpus_per_task: Optional[int] = None  # None: the profile's vCPUs when known
    # Collective timeout (seconds) and NCCL async error handling: a hung rank fails the job instead of idling.
    nccl_timeout_s: int = 1800
    nccl_async_error_handling: bool = True
    nccl_debug: Optional[str] = None  # WARN | INFO | TRACE
    # Extra environment for every rank (HF_HOME, NCCL_SOCKET_IFNAME, ...).
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choices(self, "launch")
        for key in ("nproc_per_node", "nnodes"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"launch.{key}={value} must be >= 1 (or null: from the plan's hardware)")
        check_positive("launch.node_rank", self.node_rank, allow_zero=True)
        if self.nnodes is not None and self.node_rank >= self.nnodes:
            raise ConfigError(f"launch.node_rank={self.node_rank} must be < launch.nnodes={self.nnodes}")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"launch.master_port={self.master_port} must be in 1..65535")
        if not self.master_addr:
            raise ConfigError("launch.master_addr is empty: give node 0's hostname or IP address")
        check_positive("launch.nccl_timeout_s", self.nccl_timeout_s)
        check_positive("launch.rdzv_wait_s", self.rdzv_wait_s, allow_zero=True)
        check_positive("launch.max_restarts", self.max_restarts, allow_zero=True)
        if self.session is not None and not re.fullmatch(r"[\w-]+", self.session):
            raise ConfigError(
                f"launch.session={self.session!r}: use letters, digits, '-' and '_' (tmux names)"
            )
        for key in ("slurm_partition", "slurm_account"):  # written into slurm.sbatch's #SBATCH lines
            value = getattr(self, key)
            if value is not None and not re.fullmatch(r"[\w.,:+-]+", value):
                raise ConfigError(
                    f"launch.{key}={value!r}: use letters, digits and . , : + - _ (SLURM names)"
                )
        if self.slurm_cpus_per_task is not None and self.slurm_cpus_per_task < 1:
            raise ConfigError(f"launch.slurm_cpus_per_task={self.slurm_cpus_per_task} must be >= 1")
        if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", self.slurm_time):
            raise ConfigError(
                f"launch.slurm_time={self.slurm_time!r}: use SLURM's format, e.g. 24:00:00 or 2-00:00:00"
            )
        for name in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ConfigError(f"launch.env.{name}: not a valid environment variable name")
