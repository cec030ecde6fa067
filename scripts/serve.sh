#!/usr/bin/env bash
# Install what is missing, then serve serve_config.yaml (the embedded default model unless it names a checkpoint) on
# port 8000. Extra arguments go to `serve run`; in an activated .venv, `serve run serve_config.yaml` does the same.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec .venv/bin/serve run serve_config.yaml "$@"
