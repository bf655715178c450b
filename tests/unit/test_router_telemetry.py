"""The router's metrics: labelled with the model it serves even when it learns the name late, and
every series exported at 0 from the start."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tandem.worker import metrics as m
from tandem.worker.router.telemetry import RouterTelemetry


def samples(t: RouterTelemetry) -> dict[tuple[str, str, str], float]:
    return {(s.name, s.labels.get("model", ""), s.labels.get("reason", "")): s.value
            for f in text_string_to_metric_families(t.render().decode()) for s in f.samples
            if s.name.startswith("tandem_")}


def test_series_exist_at_zero_from_the_start() -> None:
    found = samples(RouterTelemetry("tiny"))
    assert found[("tandem_migrations_total", "tiny", "")] == 0.0
    for reason in ("stop", "length", "error"):
        assert found[("tandem_requests_total", "tiny", reason)] == 0.0
    assert found[("tandem_time_to_first_token_seconds_count", "tiny", "")] == 0.0
    assert found[("tandem_prompt_tokens_total", "tiny", "")] == 0.0


def test_counts_before_the_name_is_known_land_under_the_name() -> None:
    t = RouterTelemetry(None)
    t.inc(m.REQUESTS, reason="error")
    t.inc(m.REQUESTS, reason="error")
    assert t.model is None and samples(t) == {}
    t.bind("tiny")
    t.bind("other")  # the first name sticks
    t.inc(m.REQUESTS, reason="error")
    found = samples(t)
    assert {model for _, model, _ in found} == {"tiny"}
    assert found[("tandem_requests_total", "tiny", "error")] == 3.0
    assert t.model == "tiny"
