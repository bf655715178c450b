"""The control API's versions (worker/server/protocol.py): every Sampling field a worker of version 3 did
not know is recorded with the version that brought it, and a request's sampling says which workers may
take it (the router sends it to no older one: tests/serving/test_structured_routing.py)."""

from __future__ import annotations

import pytest

from tandem.worker.server.protocol import (
    CONTROL_API_VERSION,
    SAMPLING_FIELDS_SINCE,
    Grammar,
    Sampling,
    required_api_version,
)

# Sampling as control API version 3 had it: what every worker still running understands.
VERSION_3_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "logprobs"}


def test_every_newer_sampling_field_names_the_version_that_brought_it() -> None:
    newer = set(Sampling.model_fields) - VERSION_3_FIELDS
    assert newer == set(SAMPLING_FIELDS_SINCE), (
        "a Sampling field a version 3 worker would ignore needs its entry in SAMPLING_FIELDS_SINCE (and a "
        f"CONTROL_API_VERSION that has it): {sorted(newer ^ set(SAMPLING_FIELDS_SINCE))}")
    assert all(3 < since <= CONTROL_API_VERSION for since in SAMPLING_FIELDS_SINCE.values())


@pytest.mark.parametrize(("update", "need"), [
    ({}, (1, [])),
    ({"temperature": 0.0, "seed": 3, "stop": ["x"], "logprobs": True}, (1, [])),
    ({"grammar": Grammar(kind="json_object")}, (4, ["grammar"])),
    ({"presence_penalty": 0.5, "logit_bias": {7: 1.0}}, (4, ["presence_penalty", "logit_bias"])),
    ({"repetition_penalty": 1.0, "logit_bias": {}, "top_logprobs": 0}, (1, [])),  # the defaults ask for nothing
])
def test_a_sampling_needs_the_version_of_what_it_sets(update: dict[str, object], need: tuple[int, list[str]]) -> None:
    assert required_api_version(Sampling(**update)) == need
