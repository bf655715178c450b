#!/usr/bin/env bash
# Create .venv and install Tandem into it (editable) with the given extras, at the versions CI tests.
#   hack/setup.sh [EXTRAS]      default EXTRAS: worker,operator
# Python: $PYTHON if set, else the first of python3, python3.11, python3.12, python3.13 that is 3.11
# or newer. Versions come from requirements-lock.txt (used as pip constraints: extras outside it,
# such as rdma, still resolve from pyproject.toml's ranges). Downloads come from PyPI; pip's cache
# makes re-runs quick.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-worker,operator}"
venv="${TANDEM_VENV:-.venv}"

new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
python="${PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in python3 python3.11 python3.12 python3.13; do
    if command -v "$candidate" >/dev/null && new_enough "$candidate"; then python="$candidate"; break; fi
  done
fi
if [ -z "$python" ] || ! new_enough "$python"; then
  echo "setup: Tandem needs Python 3.11 or newer; none found (set PYTHON=/path/to/python3.X)" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv with $python ($("$python" --version 2>&1))" >&2
  if ! "$python" -m venv "$venv"; then
    echo "setup: '$python -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2
    exit 1
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
fi
echo "setup: installing tandem-serving[$extras] into $venv (torch is large: the first run takes a few minutes)" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check --progress-bar off \
  -c requirements-lock.txt -e ".[$extras]"
