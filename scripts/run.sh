#!/usr/bin/env bash
# The main job: start the server on the embedded default model, chat with it, stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python examples/serve_and_chat.py "$@"
