#!/usr/bin/env bash
# GPU check, one GPU, in under 8 minutes:
#   1. the real pipeline (scripts/gpu_pipeline.py): `python -m finetune` per case on the 8B layer
#      shapes in bf16: LoRA, QLoRA, full with 8-bit AdamW, chunked loss and checkpointing on and off,
#      the tiny recipe's whole pipeline; each run's peak against its plan, each step split into
#      data/forward/loss/backward/optimizer (train.profile), tokens/s and MFU.
#      GPU_PIPELINE_SUITE=throughput runs the throughput levers instead (packed rows vs one sequence a
#      row, sdpa/flex/flash attention, micro-batch 1/2/4, compiled layers, Liger): a second check;
#   2. the bare training loop (scripts/gpu_check.py): peak memory term by term, tokens/s and MFU.
#
#   bash scripts/gpu_check.sh OUT_DIR            # e.g. bash scripts/gpu_check.sh gpu-results
#   bash scripts/gpu_check.sh OUT_DIR --cpu      # the same code paths on tiny shapes, no GPU needed
#
# Installs nothing: it uses the Python environment it finds ($PYTHON, else the active venv's
# python, else python3) and stops if a package is missing (scripts/gpu_wheels.sh prepares wheels for
# a GPU machine without PyPI access). Exits non-zero when a pipeline case fails. Feed OUT_DIR/results.json
# to scripts/calibrate.py.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 OUT_DIR [--cpu] [gpu_check.py options]" >&2
    exit 2
fi
OUT_DIR=$1
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-$(command -v python || command -v python3)}
PIPELINE_S=${GPU_PIPELINE_BUDGET_S:-300}   # gpu_pipeline.py's cases
LOOP_S=${GPU_LOOP_BUDGET_S:-110}           # gpu_check.py's cases
# gpu_pipeline.py's suite: memory (the pipeline's correctness and each run's peak against its plan, the
# default) | throughput (the levers' tokens/s and step split; run it as a second check) | all
SUITE=${GPU_PIPELINE_SUITE:-memory}
# each stage has its own hard stop: 330 + 150 s at most (8 min)

"$PY" - <<'EOF'
import importlib.util, sys
wanted = ("torch", "transformers", "peft", "bitsandbytes", "trl", "datasets", "hydra", "antlr4", "datasketch")
missing = [m for m in wanted if importlib.util.find_spec(m) is None]
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
CPU=""
for arg in "$@"; do [[ $arg == --cpu ]] && CPU=--cpu; done
status=0
# shellcheck disable=SC2086  # $CPU is empty or one word
timeout --signal=TERM --kill-after=15 "$((PIPELINE_S + 30))" "$PY" "$HERE/gpu_pipeline.py" "$OUT_DIR" \
    --budget-s "$PIPELINE_S" --suite "$SUITE" $CPU || status=$?
timeout --signal=TERM --kill-after=15 "$((LOOP_S + 40))" "$PY" "$HERE/gpu_check.py" "$OUT_DIR" --budget-s "$LOOP_S" "$@" \
    || status=$((status ? status : $?))
echo "results: $OUT_DIR/pipeline.md, $OUT_DIR/results.md (and .json of each)"
exit "$status"
