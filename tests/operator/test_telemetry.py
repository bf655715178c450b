"""The operator's own metrics: the reconcile-error series exists at 0 from the first reconcile."""

from __future__ import annotations

import uuid

from prometheus_client import REGISTRY

from tandem.operator.telemetry import count_reconcile
from tandem.worker import metrics as m


def test_reconcile_error_series_starts_at_zero_and_counts_failures() -> None:
    labels = {m.LABEL_NAMESPACE: "team-a", m.LABEL_NAME: f"dm-{uuid.uuid4().hex[:6]}"}
    errors = m.exposed_name(m.RECONCILE_ERRORS)
    assert REGISTRY.get_sample_value(errors, labels) is None
    count_reconcile(labels[m.LABEL_NAMESPACE], labels[m.LABEL_NAME], failed=False)
    assert REGISTRY.get_sample_value(errors, labels) == 0, "a dashboard shows 0, not 'No data'"
    assert REGISTRY.get_sample_value(m.exposed_name(m.RECONCILES), labels) == 1
    count_reconcile(labels[m.LABEL_NAMESPACE], labels[m.LABEL_NAME], failed=True)
    assert REGISTRY.get_sample_value(errors, labels) == 1
