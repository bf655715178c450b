#!/usr/bin/env bash
# Every check that needs a GPU, in one run on the lent device machine (docs/development.md, "GPU checks").
# Prepare here first: hack/gpu_wheels.sh. Then, through the session's device tool:
#   run(command="bash hack/gpu_checks.sh", carry=[".gpu-wheels"], timeout_s=570)
# The machine's image has its own python3 and torch (CUDA) and no network: the packages it lacks come
# from .gpu-wheels, and the repo is imported in place (a `tandem` package of links to worker/ and
# operator/) instead of being installed. Each step's output goes to $OUT (8 files at most come back);
# a failing step does not stop the next one; the exit status is the number of steps that failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
failed=0
step() {  # step NAME TIMEOUT_S COMMAND...: run it, log to $OUT/NAME.log, note the outcome in summary.txt
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 12 "$OUT/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

deps=/tmp/tandem-deps shim=/tmp/tandem-shim
python3 -m pip install --quiet --no-index --find-links .gpu-wheels --target "$deps" \
  pydantic pyzmq fastapi uvicorn pytest-timeout || { echo "could not install .gpu-wheels (run hack/gpu_wheels.sh here first)"; exit 99; }
mkdir -p "$shim/tandem"
ln -sfn "$PWD/worker" "$shim/tandem/worker"
ln -sfn "$PWD/operator" "$shim/tandem/operator"
: >"$shim/tandem/__init__.py"
export PYTHONPATH="$shim:$deps"

{ date -u; nvidia-smi; python3 -c 'import sys, torch; print(sys.version); print("torch", torch.__version__,
  "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")'; } \
  >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"

step tests 150 python3 -m pytest -q -rs -p no:cacheprovider --timeout 120 \
  tests/engine/test_cuda.py tests/transfer/test_cuda_transfer.py tests/transfer/test_conformance.py
step doctor 40 python3 -m tandem.worker.cli doctor --seconds 1
step bench_engine 150 python3 hack/bench_engine.py --skip-cpu --json "$OUT/bench_engine.json"
step serve 120 python3 hack/gpu_serve_check.py --json "$OUT/serve.json"
# No GPU in it, but 16 cores: the tcp transport against the raw socket without the 2-core VM's contention.
step bench_transfer 90 python3 hack/bench_transfer.py --sizes 64K,1M,4M,16M,64M --seconds 3 --rounds 6 \
  --variant tcp --variant unchecked:checks=off --variant zmq:floor=1
echo "== $failed step(s) failed" | tee -a "$OUT/summary.txt"
exit "$failed"
