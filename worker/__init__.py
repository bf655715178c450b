"""Tandem worker: engine, KV transfer, worker server, router and CLI."""
