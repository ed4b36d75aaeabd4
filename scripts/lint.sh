#!/usr/bin/env bash
# Lint and type-check in one go: python scripts/lint.sh (or bash scripts/lint.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check finetune scripts tests
ruff format --check finetune scripts tests
mypy
