"""The worker command line the operator builds, run as real processes: the pods' workers must come up.

Each pool's container command (`tandem` + builders.worker_args) runs exactly as built, with the
pool's env as the pod would get it. Only the pool's `args` (appended last, as on a pod) move the
ports off 8000/5555 and the host to 127.0.0.1, since this machine is shared; `device: cpu` is the
override a cluster without real GPUs uses, and `--control-token-file` to where the control token Secret's
data is written out as the kubelet would mount it. Both workers must answer /health and /ready with 200,
report the same KV layout hash (computed from the model each loaded), and serve a completion
through a router, which pairs them by that hash.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.operator import builders
from tandem.operator.api import DisaggregatedModelSpec
from tandem.worker.server import control_token
from tandem.worker.server.control_token import ControlTokens
from tandem.worker.server.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-operator")


def tandem_command() -> str:
    found = shutil.which("tandem", path=str(Path(sys.executable).parent)) or shutil.which("tandem")
    assert found, "the `tandem` console script is not installed next to this Python"
    return found


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's env as the kubelet would set it (downward-API values made up)."""
    env = dict(os.environ)
    for var in container["env"]:
        env[var["name"]] = var.get("value", f"fake-{var['name'].lower()}")
    return env


def wait_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"{url} never answered 200: {log.read_text()[-3000:]}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.send_signal(signal.SIGTERM)
    for proc in started:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_the_operators_worker_command_line_serves(tiny_model: Path, tmp_path: Path,
                                                  processes: list[subprocess.Popen[bytes]]) -> None:
    ports = {pool: (free_port(), free_port()) for pool in ("prefill", "decode")}
    secret = builders.control_token_secret(OWNER, control_token.generate())
    token_file = tmp_path / "control" / builders.CONTROL_TOKEN_KEY  # the Secret's volume, as the kubelet writes it
    token_file.parent.mkdir()
    token_file.write_bytes(base64.b64decode(secret["data"][builders.CONTROL_TOKEN_KEY]))
    control = ControlTokens.from_file(token_file)

    def pool(name: str) -> dict[str, Any]:
        http, kv = ports[name]
        return {"device": "cpu", "args": ["--host", "127.0.0.1", "--port", str(http), "--kv-port", str(kv),
                                          "--kv-cache-bytes", str(8 << 20), "--control-token-file", str(token_file)]}

    spec = DisaggregatedModelSpec.model_validate({
        "model": {"name": "tiny-llama", "source": {"path": str(tiny_model)}, "maxModelLen": 512},
        "prefill": pool("prefill"), "decode": pool("decode"),
    })
    urls = {}
    for name in ("prefill", "decode"):
        template = builders.worker_pod_template(OWNER, spec, name, "fingerprint")
        container = template["spec"]["containers"][0]
        assert container["args"][:len(builders.worker_args(OWNER, spec, name))] == builders.worker_args(OWNER, spec, name)
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            processes.append(subprocess.Popen([tandem_command(), *container["args"]], env=pod_env(container),
                                              stdout=out, stderr=subprocess.STDOUT))
        urls[name] = f"http://127.0.0.1:{ports[name][0]}"
    for name, proc in zip(("prefill", "decode"), processes, strict=True):
        for path in ("/health", "/ready"):  # liveness and readiness, as the pod's probes ask
            wait_ok(urls[name] + path, proc, tmp_path / f"{name}.log")

    infos = {name: httpx.get(f"{url}/info", headers=control.headers, timeout=5).json() for name, url in urls.items()}
    assert infos["prefill"]["layout_hash"] == infos["decode"]["layout_hash"] != ""
    assert {info["role"] for info in infos.values()} == {"prefill", "decode"}

    port = free_port()
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        router = subprocess.Popen([tandem_command(), "router", "--port", str(port), "--model", str(tiny_model),
                                   "--prefill", urls["prefill"], "--decode", urls["decode"],
                                   "--control-token-file", str(token_file)],
                                  stdout=out, stderr=subprocess.STDOUT)
    processes.append(router)
    wait_ok(f"http://127.0.0.1:{port}/ready", router, log, timeout=60)
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                      json={"model": "tiny-llama", "prompt": "hello there", "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    # The KV went from prefill to decode (the workers paired and their handshake agreed).
    decode = httpx.get(f"{urls['decode']}/metrics", timeout=5).text
    received = [line for line in decode.splitlines()
                if line.startswith("tandem_kv_transfer_bytes_total{") and 'direction="recv"' in line]
    assert received and sum(float(line.rsplit(" ", 1)[1]) for line in received) > 0, decode
