"""spec.model.source.sizeLimit: the emptyDir a uri source is fetched into gets a sizeLimit (100Gi unless the
resource says), and the fetch-model init container the same limit in bytes, so an archive too large for it is
refused with a message (tests/unit/test_fetch_model.py) instead of filling the node's disk or getting the pod
evicted."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator import builders
from tandem.operator.api import DEFAULT_MODEL_SIZE_LIMIT, DisaggregatedModelSpec, quantity_bytes
from tandem.operator.fingerprint import spec_fingerprint

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")
URI = "https://models.example/tiny.tar.gz"


def spec_of(source: dict[str, Any]) -> DisaggregatedModelSpec:
    return DisaggregatedModelSpec.model_validate({"model": {"name": "tiny", "source": source}})


def pod_of(spec: DisaggregatedModelSpec) -> dict[str, Any]:
    return builders.worker_pod_template(OWNER, spec, "decode", "fp")["spec"]  # type: ignore[no-any-return]


def model_volume(pod: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in pod["volumes"] if v["name"] == "model")


def max_bytes(pod: dict[str, Any]) -> int:
    args = pod["initContainers"][0]["args"]
    return int(args[args.index("--max-bytes") + 1])


@pytest.mark.parametrize(("size_limit", "emptydir", "limit"), [
    (None, DEFAULT_MODEL_SIZE_LIMIT, 100 << 30),
    ("40Gi", "40Gi", 40 << 30),
    ("1.5Ti", "1.5Ti", 3 << 39),
    ("500G", "500G", 500 * 10**9),
    (2_000_000_000, "2000000000", 2_000_000_000),
])
def test_the_model_empty_dir_and_fetch_model_get_the_same_limit(size_limit: str | int | None, emptydir: str,
                                                                 limit: int) -> None:
    source: dict[str, Any] = {"uri": URI} | ({"sizeLimit": size_limit} if size_limit is not None else {})
    pod = pod_of(spec_of(source))
    assert model_volume(pod) == {"name": "model", "emptyDir": {"sizeLimit": emptydir}}
    assert max_bytes(pod) == limit == quantity_bytes(emptydir)


def test_the_size_limit_is_not_part_of_the_spec_fingerprint() -> None:
    """The fingerprint names what decides the KV a worker makes; the room the archive is fetched into does not."""
    assert spec_fingerprint(spec_of({"uri": URI})) == spec_fingerprint(spec_of({"uri": URI, "sizeLimit": "40Gi"}))
    assert spec_fingerprint(spec_of({"uri": URI})) != spec_fingerprint(spec_of({"uri": URI + "?v=2"}))


@pytest.mark.parametrize(("quantity", "count"), [
    ("100Gi", 107_374_182_400), ("1Ki", 1024), ("1k", 1000), ("1M", 10**6), ("0.5Gi", 1 << 29), (".5Mi", 1 << 19),
    ("+3", 3), ("1e3", 1000), ("2E2", 200), ("1E", 10**18), ("1500m", 2), ("2.5", 3), (7, 7),
])
def test_quantities_become_whole_numbers_rounded_up(quantity: str | int, count: int) -> None:
    assert quantity_bytes(quantity) == count


def test_a_size_limit_needs_a_uri() -> None:
    with pytest.raises(ValueError, match="sizeLimit bounds the volume a uri's archive is fetched into"):
        spec_of({"path": "/models/tiny", "sizeLimit": "40Gi"})
