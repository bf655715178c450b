#!/usr/bin/env bash
# Local Kubernetes control plane with fake GPU pools: hack/cluster.sh up|down|env|build
# See hack/cluster.py for what it does; it needs only python3, go and openssl.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec python3 "$here/cluster.py" "$@"
