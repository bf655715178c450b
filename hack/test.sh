#!/usr/bin/env bash
# Install everything the tests need, then run lint, type checks, the user's install checks and the
# whole test suite.
#   hack/test.sh [pytest args]
# The install checks (hack/install_check.py) run the README's first command in a copy of this
# checkout on Python 3.11, and build the wheel and serve from it in a clean Python 3.13 venv;
# TANDEM_SKIP_INSTALL_CHECKS=1 skips them (for quick local runs; CI never sets it).
# Installs: Debian's packages (prometheus; containerd, runc, CNI plugins, iptables, conntrack,
# buildah, mmdebstrap and gcc for the real node and its images; when missing, needs root or sudo),
# the Python packages into .venv, the local control plane's binaries (built from pinned Go modules
# on first use, then reused from ~/.cache/tandem) and the local images (hack/images.py, cached there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

debs=(prometheus containerd runc containernetworking-plugins iptables conntrack buildah mmdebstrap gcc libc6-dev)
missing=()
for deb in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$deb" 2>/dev/null | grep -q "install ok installed" || missing+=("$deb")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "test: installing Debian packages: ${missing[*]}" >&2
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
hack/setup.sh worker,operator,test,dev
echo "test: building or reusing the control plane binaries" >&2
python3 hack/k8s_build.py >/dev/null
if [ "$(id -u)" = 0 ]; then
  echo "test: building or reusing the local images (after ${SECONDS}s)" >&2
  .venv/bin/python hack/images.py build
fi

echo "test: setup done after ${SECONDS}s; ruff" >&2
.venv/bin/ruff check .
echo "test: mypy" >&2
hack/typecheck.sh
if [ "${TANDEM_SKIP_INSTALL_CHECKS:-0}" != 1 ]; then
  echo "test: the README's first command, as a user runs it (after ${SECONDS}s)" >&2
  .venv/bin/python hack/install_check.py quickstart --python "${TANDEM_QUICKSTART_PYTHON:-python3.11}"
  echo "test: the wheel, installed into a clean environment (after ${SECONDS}s)" >&2
  .venv/bin/python hack/install_check.py wheel --python "${TANDEM_WHEEL_PYTHON:-python3.13}"
else
  echo "test: TANDEM_SKIP_INSTALL_CHECKS=1: the quickstart and wheel checks are skipped" >&2
fi
echo "test: pytest (after ${SECONDS}s)" >&2
exec .venv/bin/pytest "$@"
