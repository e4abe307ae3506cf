#!/usr/bin/env bash
# The main job: generate a few chat completions with the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/quickstart.py "$@"
