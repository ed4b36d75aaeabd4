#!/usr/bin/env bash
# GPU check: peak memory against the plan, tokens/s and MFU on one GPU, in under 8 minutes.
#
#   bash scripts/gpu_check.sh OUT_DIR            # e.g. bash scripts/gpu_check.sh gpu-results
#   bash scripts/gpu_check.sh OUT_DIR --cpu      # the same code path on tiny shapes, no GPU needed
#
# Installs nothing: it uses the Python environment it finds ($PYTHON, else the
# active venv's python, else python3) and stops if torch, transformers, peft or
# bitsandbytes is missing. Prints nvidia-smi, then runs scripts/gpu_check.py
# under a hard timeout. Feed OUT_DIR/results.json to scripts/calibrate.py.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 OUT_DIR [--cpu] [gpu_check.py options]" >&2
    exit 2
fi
OUT_DIR=$1
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-$(command -v python || command -v python3)}
LIMIT_S=${GPU_CHECK_TIMEOUT_S:-475}   # gpu_check.py budgets 420 s of cases; this is the hard stop (< 8 min)

"$PY" - <<'EOF'
import importlib.util, sys
missing = [m for m in ("torch", "transformers", "peft", "bitsandbytes") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing {', '.join(missing)} in this environment (nothing is installed by this script)")
EOF

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi
else
    echo "nvidia-smi: not found"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

mkdir -p "$OUT_DIR"
timeout --signal=TERM --kill-after=15 "$LIMIT_S" "$PY" "$HERE/gpu_check.py" "$OUT_DIR" "$@"
echo "results: $OUT_DIR/results.md, $OUT_DIR/results.json"
