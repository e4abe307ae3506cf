#!/usr/bin/env bash
# Runs the whole test suite (installs what it needs first).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
