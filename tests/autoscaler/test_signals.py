"""PromQL building and result parsing (pure), and fetch failures against real sockets on 127.0.0.1."""

from __future__ import annotations

import http.server
import math
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.operator import signals as s
from tandem.worker import metrics as m

SEL = s.Selector(namespace="team-a", resource="llama-8b", pool="prefill")


def test_prefill_queries_use_the_shared_metric_names_and_all_three_labels() -> None:
    q = s.pool_queries(s.PREFILL, SEL)
    labels = '{namespace="team-a",tandem_dev_model="llama-8b",pool="prefill"}'
    assert q[s.QUEUE_REQUESTS] == (f"sum({m.PREFILL_QUEUE_REQUESTS.name}{labels}) / "
                                   f"sum({m.WORKER_READY.name}{labels})")
    assert q[s.QUEUE_TOKENS].startswith(f"sum({m.PREFILL_QUEUE_TOKENS.name}{labels})")
    assert q[s.LATENCY_P] == (f'histogram_quantile(0.9, sum by (le) (rate({m.TTFT.name}_bucket'
                              '{namespace="team-a",tandem_dev_model="llama-8b",role=~"prefill|both"}[1m])))')


def test_decode_queries_use_kv_usage_and_itl() -> None:
    sel = s.Selector("team-a", "llama-8b", "decode")
    q = s.pool_queries(s.DECODE, sel, s.QuerySettings(quantile=0.99, rate_window="2m"))
    assert set(q) == {s.KV_USAGE, s.LATENCY_P}
    assert q[s.KV_USAGE].startswith(f'sum({m.KV_USAGE_RATIO.name}{{namespace="team-a"')
    assert q[s.LATENCY_P].startswith(f"histogram_quantile(0.99, sum by (le) (rate({m.ITL.name}_bucket")
    assert q[s.LATENCY_P].endswith('role=~"decode|both"}[2m])))')


def test_an_optional_role_narrows_a_shared_pool_label() -> None:
    q = s.pool_queries(s.PREFILL, s.Selector("ns", "tiny", "local", role="prefill"))
    assert '{namespace="ns",tandem_dev_model="tiny",pool="local",role="prefill"}' in q[s.QUEUE_REQUESTS]
    assert 'role=~"prefill|both"' in q[s.LATENCY_P]


def test_label_values_are_escaped() -> None:
    sel = s.Selector("ns", 'weird"model\\name', "prefill")
    assert 'tandem_dev_model="weird\\"model\\\\name"' in sel.matchers()


@pytest.mark.parametrize(("build", "message"), [
    (lambda: s.Selector("", "m", "prefill"), "namespace is empty"),
    (lambda: s.Selector("ns", "", "prefill"), "resource is empty"),
    (lambda: s.Selector("ns", "m", "prefill", role=""), "role is empty"),
    (lambda: s.pool_queries("router", SEL), "unknown pool 'router'"),
    (lambda: s.QuerySettings(quantile=1.0), "quantile"),
    (lambda: s.QuerySettings(rate_window="1 minute"), "rate window"),
    (lambda: s.per_ready_replica(m.TTFT, SEL), "not a gauge"),
    (lambda: s.latency_quantile(m.KV_USAGE_RATIO, SEL, s.QuerySettings(), "decode"), "not a histogram"),
])
def test_bad_inputs_fail_with_a_clear_message(build: Any, message: str) -> None:
    with pytest.raises(s.SignalsError, match=message):
        build()


@pytest.mark.parametrize(("result", "value", "why"), [
    ([{"metric": {}, "value": [1.0, "2.5"]}], 2.5, None),
    ([{"metric": {}, "value": [1.0, "0"]}], 0.0, None),  # a real zero stays zero
    ([], None, "no series"),
    ([{"metric": {}, "value": [1.0, "NaN"]}], None, "value is nan"),
    ([{"metric": {}, "value": [1.0, "+Inf"]}], None, "value is inf"),
    ([{"metric": {}, "value": [1.0, "1"]}, {"metric": {}, "value": [1.0, "2"]}], None, "2 series"),
    ([{"metric": {}}], None, "malformed"),
])
def test_results_become_a_number_or_missing_never_a_made_up_zero(
        result: list[dict[str, Any]], value: float | None, why: str | None) -> None:
    got, reason = s.scalar_from_result(result)
    assert got == value
    assert (reason is None) if why is None else (why in str(reason))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_prometheus_down_means_every_value_missing_and_says_so() -> None:
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    got = s.PrometheusSignals(url, timeout_s=2).fetch(s.PREFILL, SEL)
    assert got.values == {}
    assert set(got.problems) == {s.QUEUE_REQUESTS, s.QUEUE_TOKENS, s.LATENCY_P}
    assert "ConnectionError" in got.problems[s.QUEUE_REQUESTS] and url in got.problems[s.QUEUE_REQUESTS]


class _Unavailable(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(503)
        self.end_headers()
        self.wfile.write(b"overloaded")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def unavailable_server() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_http_error_is_missing_too(unavailable_server: str) -> None:
    got = s.PrometheusSignals(unavailable_server, timeout_s=2).fetch(s.DECODE, s.Selector("ns", "m", "decode"))
    assert got.get(s.KV_USAGE) is None
    assert "503" in got.problems[s.KV_USAGE]
    assert not any(isinstance(v, float) and math.isfinite(v) for v in got.values.values())


def test_no_prometheus_configured_is_missing_with_the_reason() -> None:
    got = s.NoSignals().fetch(s.PREFILL, SEL)
    assert got.values == {}
    assert "--prometheus-url" in got.problems[s.QUEUE_REQUESTS]


# ---------------------------------------------------------------- the predictive policy's arrival queries

ROUTER = '{namespace="team-a",tandem_dev_model="llama-8b",pool="router"}'
PREFILL_LABELS = '{namespace="team-a",tandem_dev_model="llama-8b",pool="prefill"}'


def test_arrival_queries_read_the_routers_counters_keyed_on_the_resource() -> None:
    q = s.arrival_queries("team-a", "llama-8b")
    prompt = f"sum(rate({m.PROMPT_TOKENS.name}_total{ROUTER}[1m]))"
    assert q[s.ARRIVAL_PROMPT_TPS] == prompt
    assert q[s.ARRIVAL_PROMPT_TREND] == f"deriv(({prompt})[2m:15s])"
    assert q[s.ARRIVAL_REQUEST_RATE] == f"sum(rate({m.TTFT.name}_count{ROUTER}[1m]))"
    assert q[s.ARRIVAL_OUTPUT_TPS] == f"sum(rate({m.GENERATION_TOKENS.name}_total{ROUTER}[1m]))"
    assert q[s.ARRIVAL_FINISHED_RATE] == (f'sum(rate({m.REQUESTS.name}_total{ROUTER[:-1]},reason!="error"}}[1m]))')
    assert q[s.ARRIVAL_BACKLOG_TOKENS] == f"sum({m.PREFILL_QUEUE_TOKENS.name}{PREFILL_LABELS})"
    assert q[s.ARRIVAL_DECODE_WAITING] == (
        f'sum({m.WAITING_REQUESTS.name}{{namespace="team-a",tandem_dev_model="llama-8b",pool="decode"}})')
    assert q[s.ARRIVAL_PREFILL_BUSY_TPS] == (
        f"(sum(rate({m.PROMPT_TOKENS.name}_total{PREFILL_LABELS}[1m])) / sum({m.WORKER_READY.name}{PREFILL_LABELS}))"
        f" and on() (min_over_time(min({m.PREFILL_QUEUE_REQUESTS.name}{PREFILL_LABELS})[1m:15s]) > 0)")
    assert set(q) >= s.ARRIVAL_OPTIONAL


def test_arrival_query_windows_come_from_the_settings_and_are_checked() -> None:
    q = s.arrival_queries("ns", "m", s.QuerySettings(rate_window="30s", trend_window="5m", trend_step="10s"))
    assert q[s.ARRIVAL_PROMPT_TREND].endswith("[30s])))[5m:10s])")
    with pytest.raises(s.SignalsError, match="trend window"):
        s.QuerySettings(trend_window="two minutes")
    with pytest.raises(s.SignalsError, match="empty"):
        s.arrival_queries("", "m")


class _Client:
    """A prometheus-api-client stand-in: a value per query name, or an exception."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers, self.asked = answers, list[str]()

    def custom_query(self, query: str, params: dict[str, Any] | None = None,
                     timeout: int | None = None) -> list[dict[str, Any]]:
        self.asked.append(query)
        for name, promql in s.arrival_queries("team-a", "llama-8b").items():
            if promql == query:
                answer = self.answers.get(name, [])
                if isinstance(answer, Exception):
                    raise answer
                return list(answer)
        raise AssertionError(query)


def _sample(value: str) -> list[dict[str, Any]]:
    return [{"metric": {}, "value": [0, value]}]


def test_fetch_arrivals_missing_values_stay_missing_and_an_optional_failure_skips_nothing() -> None:
    answers: dict[str, Any] = {name: _sample("2") for name in s.arrival_queries("team-a", "llama-8b")}
    answers[s.ARRIVAL_PREFILL_BUSY_TPS] = []  # not busy: the `and` drops the series
    answers[s.ARRIVAL_DECODE_WAITING] = RuntimeError("boom")
    answers[s.ARRIVAL_OUTPUT_TPS] = _sample("NaN")
    got = s.PrometheusSignals("http://prom", client=_Client(answers)).fetch_arrivals("team-a", "llama-8b")
    assert got.get(s.ARRIVAL_PROMPT_TPS) == 2.0 and got.get(s.ARRIVAL_FINISHED_RATE) == 2.0
    for name in (s.ARRIVAL_PREFILL_BUSY_TPS, s.ARRIVAL_DECODE_WAITING, s.ARRIVAL_OUTPUT_TPS):
        assert got.get(name) is None and name in got.problems
    assert "no series" in got.problems[s.ARRIVAL_PREFILL_BUSY_TPS]


def test_fetch_arrivals_stops_after_a_needed_query_fails() -> None:
    client = _Client({s.ARRIVAL_PROMPT_TPS: ConnectionError("refused")})
    got = s.PrometheusSignals("http://prom", client=client).fetch_arrivals("team-a", "llama-8b")
    assert got.values == {} and len(client.asked) == 1
    assert "refused" in got.problems[s.ARRIVAL_PROMPT_TPS]
    assert got.problems[s.ARRIVAL_BACKLOG_TOKENS] == "skipped after an earlier query failed"


def test_no_prometheus_configured_has_no_arrivals_either() -> None:
    got = s.NoSignals().fetch_arrivals("ns", "m")
    assert got.values == {} and "--prometheus-url" in got.problems[s.ARRIVAL_PROMPT_TPS]
