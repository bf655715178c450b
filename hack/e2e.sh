#!/usr/bin/env bash
# Tandem end to end on the test bed's real node; see hack/e2e.py.
#   hack/e2e.sh --model DIR [--keep]
# Needs root, the venv (hack/setup.sh worker,operator,test) and Debian's containerd, runc,
# containernetworking-plugins, iptables, conntrack, buildah and mmdebstrap.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="${TANDEM_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "e2e: no $venv; run hack/setup.sh worker,operator,test first" >&2
  exit 1
fi
exec "$venv/bin/python" hack/e2e.py "$@"
