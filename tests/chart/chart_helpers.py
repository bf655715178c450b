"""Shared by the chart tests: the real helm and promtool binaries, and rendering the chart."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import k8s_build  # hack/ is on sys.path (tests/conftest.py)
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tandem"
# Our helm is built from source without Helm's release ldflags, so its default Kubernetes
# version is v1.20; pass the version the local control plane runs (and the chart requires).
KUBE_VERSION = k8s_build.K8S_VERSION

Manifest = dict[str, Any]


def helm_binary() -> str:
    path = k8s_build.bin_dir() / "helm"
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm is missing at {path}: build it with `python hack/k8s_build.py` "
                    f"(helm {k8s_build.HELM_VERSION} from its Go module)", pytrace=False)
    return str(path)


def promtool_binary() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install Debian's `prometheus` package "
                    "(apt-get install -y prometheus)", pytrace=False)
    return path


def run(argv: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


def helm_template(*set_args: str, include_crds: bool = False) -> list[Manifest]:
    argv = [helm_binary(), "template", "tandem", str(CHART), "--namespace", "tandem-system",
            "--kube-version", KUBE_VERSION]
    if include_crds:
        argv.append("--include-crds")
    for value in set_args:
        argv += ["--set", value]
    proc = run(argv)
    assert proc.returncode == 0, f"helm template {set_args} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] == kind]
