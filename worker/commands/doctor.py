"""`tandem doctor`: which KV transports work here and why not, the GPU, and loopback bandwidth."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click


def gpu_report() -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda}
    if not torch.cuda.is_available():
        report["usable"] = False
        report["reason"] = ("no CUDA device: torch.cuda.is_available() is False"
                            + ("" if torch.version.cuda else " (this torch build has no CUDA)"))
        return report
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    report.update(usable=True, devices=devices,
                  gpudirect_rdma=Path("/sys/module/nvidia_peermem").exists(),
                  reason=f"{len(devices)} CUDA device(s)")
    return report


def transports_report(measure: bool, seconds: float) -> dict[str, Any]:
    from tandem.worker.transfer import choose_transport, probe

    report: dict[str, Any] = {}
    tcp: dict[str, Any] = {"usable": True, "reason": "pyzmq over TCP is always available"}
    if measure:
        from tandem.worker.transfer.loopback import measure_loopback

        try:
            result = measure_loopback(seconds=seconds)
        except Exception as exc:  # the doctor reports, it does not crash
            tcp = {"usable": False, "reason": f"loopback transfer failed: {exc}"}
        else:
            tcp["loopback"] = asdict(result)
    report["tcp"] = tcp
    rdma = probe()
    report["rdma"] = {"usable": rdma.usable, "reason": rdma.reason, "pyverbs": rdma.pyverbs,
                      "pyverbs_problem": rdma.pyverbs_problem,
                      "ports": [asdict(p) for p in rdma.ports]}
    report["auto"] = choose_transport("auto", probe_rdma=lambda: rdma)[0]
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"tandem doctor ({platform.node()}, Python {platform.python_version()})", "", "KV transports"]
    tcp = report["transports"]["tcp"]
    if tcp["usable"] and "loopback" in tcp:
        loop = tcp["loopback"]
        lines.append(f"  tcp   works. Loopback: {loop['tcp_gbps']:.2f} GB/s with {loop['transfer_bytes'] >> 20} MiB "
                     f"transfers ({loop['transfers']} verified), against {loop['socket_gbps']:.2f} GB/s for a plain "
                     f"socket ({loop['tcp_gbps'] / loop['socket_gbps']:.0%}).")
    elif tcp["usable"]:
        lines.append("  tcp   works (bandwidth not measured: --no-bandwidth).")
    else:
        lines.append(f"  tcp   does NOT work: {tcp['reason']}")
    rdma = report["transports"]["rdma"]
    lines.append(f"  rdma  {'works: ' if rdma['usable'] else 'not available: '}{rdma['reason']}")
    if rdma["pyverbs"]:
        lines.append(f"        pyverbs {rdma['pyverbs']} is installed")
    elif rdma["pyverbs_problem"] and rdma["pyverbs_problem"] != rdma["reason"]:
        lines.append(f"        and: {rdma['pyverbs_problem']}")
    for port in rdma["ports"]:
        lines.append(f"        {port['device']} port {port['port']}: {port['state']}, {port['link_layer']}, {port['rate']}")
    lines.append(f"  auto  picks {report['transports']['auto']} on this machine")
    gpu = report["gpu"]
    lines += ["", "GPU"]
    if gpu["usable"]:
        for device in gpu["devices"]:
            lines.append(f"  cuda:{device['index']}  {device['name']}, {device['memory_gib']} GiB")
        lines.append("  GPUDirect RDMA: " + ("nvidia_peermem is loaded" if gpu["gpudirect_rdma"] else
                                             "nvidia_peermem is not loaded (KV goes through host memory)"))
    else:
        lines.append(f"  none: {gpu['reason']} (torch {gpu['torch']})")
    return "\n".join(lines)


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.option("--no-bandwidth", is_flag=True, help="Skip the loopback bandwidth measurement.")
@click.option("--seconds", type=click.FloatRange(0.05, 30.0), default=0.5, show_default=True,
              help="How long to measure loopback bandwidth.")
def command(as_json: bool, no_bandwidth: bool, seconds: float) -> None:
    """Say which KV transports work here (and why not), the GPU, and loopback bandwidth."""
    report = {"transports": transports_report(not no_bandwidth, seconds), "gpu": gpu_report()}
    click.echo(json.dumps(report, indent=2) if as_json else render(report))
    if not report["transports"]["tcp"]["usable"]:
        raise SystemExit(1)
