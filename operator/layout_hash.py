"""The KV layout hash the operator puts on every worker pod.

The operator cannot see the model's geometry (layers, KV heads, head size: they live in
config.json inside the model folder), so it hashes what the spec decides and that changes
where a KV byte lives or which weights produced it: the model's identity and source, dtype,
block size and both pools' tensor-parallel sizes, plus the shared LAYOUT_VERSION. Prefill and
decode pods of one resource carry the same hash; a spec change that alters the layout changes
it, so old and new workers refuse each other during a rollout instead of pairing wrongly.
"""

from __future__ import annotations

import hashlib
import json

from tandem.operator.api import DisaggregatedModelSpec
from tandem.worker.kv.layout import LAYOUT_VERSION


def spec_layout_hash(spec: DisaggregatedModelSpec) -> str:
    payload = {
        "v": LAYOUT_VERSION,
        "model": spec.model.name,
        "source": spec.model.source.model_dump(by_alias=True, exclude_none=True),
        "dtype": spec.model.dtype,
        "block_size": spec.kv_transfer.block_size,
        "prefill_tensor_parallel": spec.prefill.gpus_per_replica,
        "decode_tensor_parallel": spec.decode.gpus_per_replica,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
