#!/usr/bin/env bash
# Wheels for a GPU machine without PyPI access whose image has torch 2.11 + CUDA 13,
# transformers 5.17, accelerate and peft, but not trl, datasets, hydra-core or bitsandbytes.
#
#   bash scripts/gpu_wheels.sh            # here (PyPI reachable): fills .whl/ for Python 3.12 x86-64
#
# Then, on the GPU machine, with .whl/ copied into the checkout there:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.whl/src || exit
#   bash scripts/gpu_check.sh "$OUT"
#
# antlr4-python3-runtime (hydra's parser) is published as source only: its pure-Python package is
# copied from this machine's environment into .whl/src. The versions are the ones the project's
# tests ran with (README).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
mkdir -p .whl/src
PY=${PYTHON:-python3}
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d .whl -q \
    trl==1.16.0 transformers==5.24.0 peft==0.21.2 datasets==5.2.0 dill multiprocess \
    hydra-core==1.3.8 omegaconf==2.3.0 bitsandbytes==0.50.2 datasketch xxhash
site=$("$PY" -c "import antlr4, os; print(os.path.dirname(antlr4.__file__))")
rm -rf .whl/src/antlr4 && cp -r "$site" .whl/src/antlr4
du -sh .whl
ls .whl
