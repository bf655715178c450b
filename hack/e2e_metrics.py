"""Prometheus for the real node: Debian's prometheus scraping the operator's pods.

Debian builds Prometheus without Kubernetes service discovery, so `kubernetes_sd_configs` (what a
real cluster uses: docs/alerts.md) is replaced by its file-based equivalent: `targets` polls the
apiserver's pod list and rewrites a file_sd file with the same targets and labels the pod role
would give (namespace, pod, and the pod label tandem.dev/model as tandem_dev_model). Everything
else is real: Prometheus scrapes each pod's /metrics on its pod IP, and the operator pod reads
the autoscaler's signals from it over the node IP.

    python3 hack/e2e_metrics.py targets --kubeconfig FILE --out FILE   (runs until killed)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import k8s_build  # noqa: E402

MANAGER = "tandem-operator"  # app.kubernetes.io/managed-by of every pod the operator creates
MODEL_LABEL = "tandem.dev/model"
SCRAPE_INTERVAL = "2s"


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """file_sd entries for the running operator-made pods with a container port named http."""
    entries = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
        labels = meta.get("labels") or {}
        if labels.get("app.kubernetes.io/managed-by") != MANAGER or status.get("phase") != "Running":
            continue
        ip = status.get("podIP")
        ports = [p["containerPort"] for c in spec.get("containers", []) for p in c.get("ports", [])
                 if p.get("name") == "http"]
        if not ip or not ports:
            continue
        entries.append({"targets": [f"{ip}:{ports[0]}"],
                        "labels": {"namespace": meta["namespace"], "pod": meta["name"],
                                   "tandem_dev_model": labels.get(MODEL_LABEL, "")}})
    return sorted(entries, key=lambda e: e["labels"]["pod"])


def prometheus_config(targets_file: Path) -> dict[str, Any]:
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": "tandem-pods", "scrape_timeout": "1s",
                                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "2s"}]}]}


def write_targets_forever(kubeconfig: Path, out: Path, period: float = 1.0) -> None:
    kubectl = str(k8s_build.bin_dir() / "kubectl")
    last = None
    while True:
        proc = subprocess.run([kubectl, f"--kubeconfig={kubeconfig}", "get", "pods", "-A", "-o", "json",
                               "-l", f"app.kubernetes.io/managed-by={MANAGER}"], capture_output=True, text=True)
        if proc.returncode == 0:
            text = json.dumps(pod_targets(json.loads(proc.stdout)["items"]), indent=1)
            if text != last:  # atomic: Prometheus never reads half a file
                tmp = out.with_suffix(".tmp")
                tmp.write_text(text)
                os.replace(tmp, out)
                last = text
        else:
            print(f"kubectl get pods failed: {proc.stderr.strip()}", file=sys.stderr, flush=True)
        time.sleep(period)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    targets = sub.add_parser("targets", help="keep a file_sd file of the operator's pods up to date")
    targets.add_argument("--kubeconfig", type=Path, required=True)
    targets.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    write_targets_forever(args.kubeconfig, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
