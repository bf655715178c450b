"""Prometheus for tests: Debian's binary, scraping an exporter this test starts."""

from __future__ import annotations

import time

import pytest
from prometheus_api_client import PrometheusConnect
from prometheus_client import CollectorRegistry, Gauge, start_http_server

pytestmark = pytest.mark.integration


def test_scrapes_an_exporter_and_reads_value_back(prometheus) -> None:  # type: ignore[no-untyped-def]
    registry = CollectorRegistry()
    gauge = Gauge("tandem_fixture_probe", "A value the test sets", ["pool"], registry=registry)
    gauge.labels(pool="decode").set(0.75)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_port
        prom = prometheus([f"127.0.0.1:{port}"])
        client = PrometheusConnect(url=prom.url, disable_ssl=True)
        deadline = time.monotonic() + 30
        result = []
        while time.monotonic() < deadline and not result:
            result = client.custom_query('tandem_fixture_probe{pool="decode"}')
            time.sleep(0.5)
        assert result, "Prometheus never returned the exporter's series"
        assert float(result[0]["value"][1]) == 0.75
        gauge.labels(pool="decode").set(0.25)
        deadline = time.monotonic() + 30
        value = 0.75
        while time.monotonic() < deadline and value != 0.25:
            value = float(client.custom_query('tandem_fixture_probe{pool="decode"}')[0]["value"][1])
            time.sleep(0.5)
        assert value == 0.25
    finally:
        server.shutdown()
