"""Where the workers are: a static list, or Kubernetes (EndpointSlices or headless-Service DNS).

Every source returns plain worker base URLs; roles, readiness and layout hashes are learned
from each worker's GET /info (see workers.py), so a source never has to be trusted about them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any, Protocol

import yaml

log = logging.getLogger(__name__)


class Discovery(Protocol):
    async def urls(self) -> list[str]: ...


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


class StaticDiscovery:
    def __init__(self, urls: list[str]) -> None:
        self._urls = sorted({normalize_url(u) for u in urls if u.strip()})

    async def urls(self) -> list[str]:
        return list(self._urls)


def read_workers_file(path: Path) -> list[str]:
    """YAML/JSON: a list of URLs, or {prefill: [...], decode: [...], workers: [...]}."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read workers file {path}: {exc}") from None
    if isinstance(data, list):
        urls = data
    elif isinstance(data, dict):
        urls = [u for key in ("prefill", "decode", "workers") for u in (data.get(key) or [])]
    else:
        raise ValueError(f"workers file {path}: expected a list of URLs or a mapping with prefill/decode lists")
    if not all(isinstance(u, str) for u in urls):
        raise ValueError(f"workers file {path}: every worker must be a URL string")
    return [str(u) for u in urls]


class FileDiscovery:
    """Re-reads the file on every refresh, so workers can be added without restarting the router."""

    def __init__(self, path: Path) -> None:
        self.path = path
        read_workers_file(path)  # fail fast on a bad file

    async def urls(self) -> list[str]:
        try:
            return sorted({normalize_url(u) for u in read_workers_file(self.path)})
        except ValueError as exc:
            log.warning("%s; keeping the previous worker list", exc)
            raise


def ready_endpoints(slices: list[dict[str, Any]], port_name: str = "http", default_port: int = 8000) -> list[str]:
    """Worker URLs from EndpointSlice objects (as dicts): ready (or unknown) endpoints only."""
    urls = set()
    for sl in slices:
        port = default_port
        for p in sl.get("ports") or []:
            if p.get("name") == port_name and p.get("port"):
                port = int(p["port"])
        family = sl.get("addressType") or sl.get("address_type") or "IPv4"
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            for addr in ep.get("addresses") or []:
                host = f"[{addr}]" if family == "IPv6" else addr
                urls.add(f"http://{host}:{port}")
    return sorted(urls)


DISCOVERY_METHODS = ("endpointslices", "dns")


class KubernetesDiscovery:
    """EndpointSlices of the headless Services via the API, or DNS A records when there is no API access.

    `kubeconfig` (endpointslices only) names a kubeconfig file to use instead of the pod's own
    ServiceAccount or the default kubeconfig; it gets a client of its own, leaving the process-wide
    default configuration alone.
    """

    def __init__(self, namespace: str, services: list[str], port: int = 8000, method: str = "endpointslices",
                 kubeconfig: Path | None = None) -> None:
        if method not in DISCOVERY_METHODS:
            raise ValueError(f"unknown discovery method {method!r}: expected one of {', '.join(DISCOVERY_METHODS)}")
        self.namespace, self.services, self.port, self.method = namespace, services, port, method
        self.kubeconfig = kubeconfig
        self._api: Any = None

    def _discovery_api(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            if self.kubeconfig is not None:
                self._api = config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]
                return self._api
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            self._api = client.ApiClient()
        return self._api

    def _slices(self, service: str) -> list[dict[str, Any]]:
        from kubernetes import client

        api = self._discovery_api()
        found = client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={service}", _request_timeout=5)
        # The API's own JSON shape (camelCase), which is what ready_endpoints reads.
        return [api.sanitize_for_serialization(item) for item in found.items]

    def _dns(self, service: str) -> list[str]:
        name = f"{service}.{self.namespace}.svc"
        try:
            infos = socket.getaddrinfo(name, self.port, proto=socket.IPPROTO_TCP)
        except socket.gaierror as exc:
            log.warning("DNS lookup of %s failed: %s", name, exc)
            return []
        return sorted({f"http://{info[4][0]}:{self.port}" for info in infos})

    async def urls(self) -> list[str]:
        out: list[str] = []
        for svc in self.services:
            if self.method == "dns":
                out += await asyncio.to_thread(self._dns, svc)
            else:
                out += ready_endpoints(await asyncio.to_thread(self._slices, svc), default_port=self.port)
        return sorted(set(out))
