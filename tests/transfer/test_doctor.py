"""`tandem doctor`, run as a user would: the real console script in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.worker.transfer import probe

TANDEM = Path(sys.executable).with_name("tandem")


def run_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TANDEM), "doctor", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_doctor_reports_transports_gpu_and_bandwidth() -> None:
    result = run_doctor("--seconds", "0.2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "tcp   works. Loopback:" in out and "GB/s" in out
    rdma = probe()
    assert rdma.reason in out  # e.g. "no RDMA device: /sys/class/infiniband does not exist ..."
    assert f"auto  picks {'rdma' if rdma.usable else 'tcp'}" in out
    assert "GPU" in out


@pytest.mark.integration
def test_doctor_json_is_machine_readable() -> None:
    result = run_doctor("--json", "--no-bandwidth")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["transports"]["tcp"]["usable"] is True
    assert report["transports"]["rdma"]["reason"] == probe().reason
    assert report["transports"]["auto"] in ("tcp", "rdma")
    assert isinstance(report["gpu"]["usable"], bool) and report["gpu"]["reason"]
