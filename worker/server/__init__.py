"""The worker process: an engine stepping in one thread behind an asyncio HTTP control API.

`tandem worker` builds it (see tandem.worker.commands.worker); the router is its only client
apart from Prometheus and the kubelet probes. The wire format lives in `protocol`.
"""
