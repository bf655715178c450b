#!/usr/bin/env bash
# Wheels the GPU device machine lacks, for its Python (3.12, with its own torch): run here, where PyPI
# is reachable, before `run` carries .gpu-wheels to that machine (hack/gpu_checks.sh installs them).
# The machine's image already holds torch, transformers, tokenizers, safetensors, httpx, click, rich,
# jinja2, xxhash, prometheus-client, pyyaml and pytest (/work/.library/device/KINDS.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf .gpu-wheels
.venv/bin/pip download --quiet --dest .gpu-wheels --only-binary=:all: --implementation cp --python-version 3.12 \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any \
  -c requirements-lock.txt pydantic pyzmq fastapi uvicorn pytest-timeout
du -sh .gpu-wheels
ls .gpu-wheels
