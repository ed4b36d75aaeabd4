"""The libraries' repeated notices and tqdm bars are quiet unless verbose=true; their errors still show."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, child_env

CHILD = """
import logging, os, sys
from finetune.core.noise import quiet_libraries
quiet_libraries(sys.argv[1] == "true")
quiet_libraries(sys.argv[1] == "true")  # twice: one filter
ds = logging.getLogger("DeepSpeed")
print("filters:", len(ds.filters))
ds.addHandler(logging.StreamHandler(sys.stdout)); ds.setLevel(logging.INFO); ds.propagate = False
ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
ds.warning("a DeepSpeed warning of its own")
ds.error("Setting accelerator to CPU failed")
bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
bnb.addHandler(logging.StreamHandler(sys.stdout))
bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community")
bnb.error("a bitsandbytes error")
print("bars off:", os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS"), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"))
"""


# what an earlier quiet_libraries() in this test process may have set: the child starts without them
BARS = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")


def _run(verbose: str) -> list[str]:
    env = {k: v for k, v in child_env().items() if k not in BARS}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, verbose], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_quiet_by_default_errors_and_own_warnings_still_show():
    assert _run("false") == [
        "filters: 1",
        "a DeepSpeed warning of its own",
        "Setting accelerator to CPU failed",
        "a bitsandbytes error",
        "bars off: 1 1",
    ]


def test_verbose_leaves_every_library_as_it_is():
    assert _run("true") == [
        "filters: 0",
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
        "a DeepSpeed warning of its own",
        "Setting accelerator to CPU failed",
        "Failed to load CPU gemm_4bit_forward from kernels-community",
        "a bitsandbytes error",
        "bars off: None None",
    ]
