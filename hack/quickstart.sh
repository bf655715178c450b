#!/usr/bin/env bash
# The main job on one machine: install, then run the whole P/D stack on a tiny random model.
#   hack/quickstart.sh [extra `tandem serve` flags]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
hack/setup.sh worker
exec .venv/bin/tandem serve --model tiny --prefill-workers 1 --decode-workers 1 "$@"
