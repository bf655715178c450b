"""Transport selection and RDMA discovery.

The fake /sys/class/infiniband trees below are real directories in tmp_path laid out like the
kernel's; they stand in for RDMA hardware, which this machine does not have.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem.worker import metrics as m
from tandem.worker.transfer import RdmaProbe, TransferError, TransferTelemetry, choose_transport, probe
from tandem.worker.transfer.rdma_probe import PYVERBS_MISSING, load_pyverbs, sysfs_ports


def fake_sysfs(root: Path, state: str = "4: ACTIVE") -> Path:
    port = root / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text("InfiniBand\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    return root


def pyverbs_installed() -> bool:
    try:
        load_pyverbs()
    except TransferError:
        return False
    return True


def test_missing_sysfs_says_so(tmp_path: Path) -> None:
    found = probe(tmp_path / "infiniband")
    assert not found.usable
    assert found.reason.startswith("no RDMA device:") and "does not exist" in found.reason


def test_empty_sysfs_says_so(tmp_path: Path) -> None:
    (tmp_path / "infiniband").mkdir()
    found = probe(tmp_path / "infiniband")
    assert not found.usable and found.reason.endswith("/infiniband is empty")


def test_port_down_is_reported_with_its_state(tmp_path: Path) -> None:
    found = probe(fake_sysfs(tmp_path / "ib", state="1: DOWN"))
    assert not found.usable and "no port is ACTIVE" in found.reason and "mlx5_0 port 1: 1: DOWN" in found.reason


def test_sysfs_ports_are_read(tmp_path: Path) -> None:
    (port,) = sysfs_ports(fake_sysfs(tmp_path / "ib"))
    assert (port.device, port.port, port.link_layer, port.active) == ("mlx5_0", 1, "InfiniBand", True)


@pytest.mark.skipif(pyverbs_installed(), reason="pyverbs is installed here, so it cannot be found missing")
def test_active_port_without_pyverbs_names_the_fix(tmp_path: Path) -> None:
    found = probe(fake_sysfs(tmp_path / "ib"))
    assert not found.usable and found.reason == PYVERBS_MISSING
    assert "pip install 'tandem-serving[rdma]'" in found.reason and "docs/transfer.md" in found.reason
    with pytest.raises(TransferError) as unavailable:
        load_pyverbs()
    assert unavailable.value.reason == "unavailable" and PYVERBS_MISSING in str(unavailable.value)


def test_auto_falls_back_to_tcp_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    telemetry = TransferTelemetry(model="m", role="decode", pool="p")
    caplog.set_level(logging.INFO)
    kind, why = choose_transport("auto", telemetry, lambda: RdmaProbe(False, "no RDMA device: test"))
    assert kind == "tcp" and "no RDMA device: test" in why
    assert any("KV transport: tcp" in r.getMessage() for r in caplog.records)
    sample = telemetry.registry.get_sample_value
    labels = {"model": "m", "role": "decode", "pool": "p"}
    assert sample(m.KV_TRANSPORT_INFO.name, {**labels, "transport": "tcp"}) == 1
    assert sample(m.KV_TRANSPORT_INFO.name, {**labels, "transport": "rdma"}) == 0


def test_auto_picks_rdma_when_usable() -> None:
    assert choose_transport("auto", probe_rdma=lambda: RdmaProbe(True, "mlx5_0 port 1 ACTIVE"))[0] == "rdma"


def test_explicit_rdma_that_cannot_run_raises_with_the_reason() -> None:
    with pytest.raises(TransferError) as unavailable:
        choose_transport("rdma", probe_rdma=lambda: RdmaProbe(False, PYVERBS_MISSING))
    assert unavailable.value.reason == "unavailable" and "pip install 'tandem-serving[rdma]'" in str(unavailable.value)


def test_unknown_transport_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="auto, tcp, rdma"):
        choose_transport("udp")


def test_this_machine_runs_tcp_under_auto() -> None:
    found = probe()
    kind, why = choose_transport("auto")
    assert kind == ("rdma" if found.usable else "tcp")
    assert found.reason in why
