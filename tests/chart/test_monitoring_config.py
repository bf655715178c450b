"""The shared PromQL building blocks refuse metrics, suffixes and labels that do not exist."""

from __future__ import annotations

import monitoring_config as cfg
import pytest

from tandem.worker import metrics as m


def test_counter_gets_total_suffix_and_matchers_render_escaped() -> None:
    expr = cfg.series(m.REQUESTS, matchers=[cfg.eq("reason", 'st"op'), cfg.regex("model", "a|b")])
    assert expr == 'tandem_requests_total{reason="st\\"op", model=~"a|b"}'


def test_histogram_needs_a_histogram_suffix() -> None:
    assert cfg.series(m.TTFT, "_bucket") == "tandem_time_to_first_token_seconds_bucket"
    with pytest.raises(ValueError, match="histogram"):
        cfg.series(m.TTFT)
    with pytest.raises(ValueError, match="gauge"):
        cfg.series(m.KV_USAGE_RATIO, "_total")


def test_unknown_label_is_refused() -> None:
    with pytest.raises(ValueError, match="no label 'transport'"):
        cfg.series(m.KV_USAGE_RATIO, matchers=[cfg.eq("transport", "tcp")])
    with pytest.raises(ValueError, match="no label 'le'"):
        cfg.series(m.TTFT, "_count", [cfg.eq("le", "1")])


def test_le_matcher_accepts_both_spellings_of_a_real_bucket_only() -> None:
    assert cfg.le_matcher(2.0, m.TTFT).render() == 'le=~"2|2\\\\.0"'
    assert cfg.le_matcher(0.1, m.ITL).render() == 'le=~"0\\\\.1"'
    with pytest.raises(ValueError, match="not a bucket boundary"):
        cfg.le_matcher(1.7, m.TTFT)


def test_slo_thresholds_are_bucket_boundaries_and_budgets_positive() -> None:
    for slo in cfg.SLOS:
        assert slo.metric.buckets is not None and slo.threshold_seconds in slo.metric.buckets
        assert 0 < slo.error_budget < 1
    assert {slo.tier for slo in cfg.SLOS} == {"prefill", "decode"}
