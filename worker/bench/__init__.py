"""Load generation for OpenAI-compatible endpoints: `tandem bench` and the benchmark scripts.

workload: what to send and when (synthetic or a scaled trace); client: sends it and times every
token; stats: percentiles, throughput, goodput; report: table and JSON.
"""
