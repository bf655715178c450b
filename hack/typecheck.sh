#!/usr/bin/env bash
# mypy over tandem.operator and tandem.worker. The folders operator/ and worker/ are installed
# under other import names, which mypy cannot discover from an editable install; a symlink tree
# in .mypy-src/ gives it the real module names (and avoids `operator` clashing with the stdlib).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .mypy-src/tandem
ln -sfn ../../operator .mypy-src/tandem/operator
ln -sfn ../../worker .mypy-src/tandem/worker
MYPYPATH=.mypy-src exec .venv/bin/mypy -p tandem.operator -p tandem.worker "$@"
