#!/usr/bin/env bash
# Create .venv and install Tandem into it (editable) with the given extras.
#   hack/setup.sh [EXTRAS]      default EXTRAS: worker,operator
# Needs python3.11 on PATH. Downloads come from PyPI (pip's cache makes re-runs quick).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-worker,operator}"
python="${PYTHON:-python3.11}"
if ! command -v "$python" >/dev/null; then
  echo "setup: $python not found; Tandem needs Python 3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $python" >&2
  "$python" -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip setuptools wheel
fi
echo "setup: installing tandem[$extras] into .venv (torch is large: the first run takes a few minutes)" >&2
.venv/bin/pip install --quiet --progress-bar off -e ".[$extras]"
