"""The spec fingerprint the operator puts on every worker pod (label tandem.dev/spec-fingerprint).

It hashes the spec fields that decide which KV a worker produces: the model's identity and
source, dtype, block size and both pools' tensor-parallel sizes, plus the shared LAYOUT_VERSION.
It is a label for people and tools (which pods run which configuration), never a value the
worker checks: the worker cannot see the spec, and the operator cannot see the model's geometry
(it lives in config.json inside the model folder). The fence between incompatible workers is the
worker's own KV layout hash, computed from the model it loaded (tandem.worker.kv.layout): the
router pairs a prefill worker only with a decode worker of the same hash, and the KV transfer
handshake refuses a peer whose hash differs.
"""

from __future__ import annotations

import hashlib
import json

from tandem.operator.api import DisaggregatedModelSpec
from tandem.worker.kv.layout import LAYOUT_VERSION


def spec_fingerprint(spec: DisaggregatedModelSpec) -> str:
    payload = {
        "v": LAYOUT_VERSION,
        "model": spec.model.name,
        # Where the weights come from, not the room they are fetched into (sizeLimit changes no KV).
        "source": spec.model.source.model_dump(by_alias=True, exclude_none=True, exclude={"size_limit"}),
        "dtype": spec.model.dtype,
        "block_size": spec.kv_transfer.block_size,
        "prefill_tensor_parallel": spec.prefill.gpus_per_replica,
        "decode_tensor_parallel": spec.decode.gpus_per_replica,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
