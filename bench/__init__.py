"""pd-bench: the serving load tool of pd-cluster (``pd-bench --help``).

It drives any OpenAI-compatible server with synthetic or replayed-trace load,
measures TTFT, TPOT, ITL and end-to-end latency on the client with a monotonic
clock, and, when the target is a pd-cluster, breaks requests down into queue,
prefill, KV transfer and decode time from the workers' ``/metrics``.
"""
