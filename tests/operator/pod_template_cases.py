"""Pool `pod` fields next to the reserved keys and paths, which both the operator's parsing
(test_pod_template.py) and the API server's CEL rules (test_pod_template_cluster.py) must accept."""

from __future__ import annotations

from typing import Any

RESERVED_NEIGHBOURS: dict[str, dict[str, Any]] = {
    "labels": {"labels": {"nottandem.dev/x": "y", "app.kubernetes.io/part-of": "llm"}},
    "annotations": {"annotations": {"prometheus.io/scheme": "https", "tandem.dev.example/x": "y"}},
    **{name: {"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": path}]}
       for name, path in (("tmpfs", "/tmpfs"), ("etc-tandem-extra", "/etc/tandem-extra"),
                          ("dot-names", "/data/..x/.y"), ("modelsx", "/modelsx"))},
}
