#!/usr/bin/env bash
# Rewrite requirements-lock.txt: the exact versions CI, the quickstart and the images install,
# resolved from pyproject.toml's ranges for every Python >= 3.11 and platform at once (uv's
# universal resolution), in pip's requirements format so that plain pip can use it as constraints.
#   hack/lock.sh [--upgrade]     (needs the dev extra: uv)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
uv="${UV:-.venv/bin/uv}"
exec "$uv" pip compile pyproject.toml --universal --python-version 3.11 \
  --extra worker --extra operator --extra test --extra dev \
  --custom-compile-command "hack/lock.sh" -o requirements-lock.txt "$@"
