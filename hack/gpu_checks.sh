#!/usr/bin/env bash
# Every check that needs a GPU, in one run on the lent device machine (docs/development.md, "GPU checks").
# Prepare here first: hack/gpu_wheels.sh. Then, through the session's device tool:
#   run(command="bash hack/gpu_checks.sh", carry=[".gpu-wheels"], timeout_s=570)
# The machine's image has its own python3 and torch (CUDA) and no network: the packages it lacks come
# from .gpu-wheels, and the repo is imported in place (a `tandem` package of links to worker/ and
# operator/) instead of being installed. Each step's output goes to $OUT (8 files at most come back);
# a failing step does not stop the next one; the exit status is the number of steps that failed.
# GPU_CHECKS="name ..." runs only the steps named. The whole list is more than one run's 570 s and 8
# files back, so the goodput and profile steps run on their own:
#   run(command="GPU_CHECKS=goodput bash hack/gpu_checks.sh", carry=[".gpu-wheels"], timeout_s=560)
#   run(command="GPU_CHECKS=profile bash hack/gpu_checks.sh", carry=[".gpu-wheels"], timeout_s=300)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
failed=0
step() {  # step NAME TIMEOUT_S COMMAND...: run it, log to $OUT/NAME.log, note the outcome in summary.txt
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if [ -n "${GPU_CHECKS:-}" ] && [[ " $GPU_CHECKS " != *" $name "* ]]; then  # GPU_CHECKS="goodput serve": only those
    echo "== $name: skipped (not in GPU_CHECKS)" | tee -a "$OUT/summary.txt"
    return
  fi
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
# Goodput per GPU (docs/benchmarks.md, "Goodput"): the same script and code path as the CPU run, on a
# ~0.6B random-weight model in bfloat16, 2048-token long prompts; all workers share the one GPU.
if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  step goodput 480 python3 hack/bench_interference.py --goodput --device cuda --dtype bfloat16 --model gpu \
    --long-prompt-tokens 2048 --short-prompt-tokens 128 --streams 16 --goodput-output-tokens 128 \
    --kv-cache-mib 4096 --max-probes 4 --probe-seconds 10 --probe-max-requests 400 --json "$OUT/goodput.json"
else  # a dry run here: the CPU figures come from the same script without --device cuda (docs/benchmarks.md)
  echo "== goodput: skipped (no CUDA device)" | tee -a "$OUT/summary.txt"
fi
# The GPU capacity profile (docs/autoscaling.md, "Measuring a profile"): `tandem profile` starts one worker
# of the goodput step's ~0.6B random-weight model (hack/bench_interference.py MODELS["gpu"]) in bfloat16
# and measures it, bounded (about 150 requests); profile.json is what `tandem plan --profile` reads (copy
# it to deploy/profiles/). The log has the progress; the worker's own log stays on the machine.
if python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  gpu_model=/tmp/tandem-profile-gpu-model
  if [ -z "${GPU_CHECKS:-}" ] || [[ " $GPU_CHECKS " == *" profile "* ]]; then  # the step below runs: its model
    timeout 120 python3 -c 'import sys; from pathlib import Path; sys.path.insert(0, "hack")
from bench_interference import MODELS, write_model
write_model(Path(sys.argv[1]), MODELS["gpu"])' "$gpu_model" || echo "could not write the profile's model"
  fi
  step profile 240 python3 -m tandem.worker.cli profile --model "$gpu_model" --device cuda --dtype bfloat16 \
    --prompt-lengths 256,1024,2048 --batch-sizes 1,8,32 --contexts 512,2048 --decode-tokens 64 --repeats 2 \
    --startup-timeout 150 --log-dir /tmp/tandem-profile-logs --out "$OUT/profile.json"
else  # a dry run here: the CPU profile of the tiny model is measured the same way (docs/autoscaling.md)
  echo "== profile: skipped (no CUDA device)" | tee -a "$OUT/summary.txt"
fi
echo "== $failed step(s) failed" | tee -a "$OUT/summary.txt"
exit "$failed"
