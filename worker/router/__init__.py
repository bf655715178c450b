"""The OpenAI-compatible router: API surface, worker discovery, placement, and the request path
(prefill -> KV transfer -> decode, with fallback and token-level migration)."""
