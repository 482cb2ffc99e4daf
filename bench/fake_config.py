"""Configuration and command line of the fake OpenAI worker (``python -m pd_cluster.bench.fake_server``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class FakeServerConfig:
    """Behaviour of one fake worker. Times are in milliseconds."""

    host: str = "127.0.0.1"
    port: int = 0
    role: str = "mixed"
    model: str = "stories260K"
    ttft_ms: float = 50.0
    itl_ms: float = 10.0
    num_tokens: int | None = None
    queue_ms: float = 0.0
    transfer_ms: float = 0.0
    kv_bytes_per_token: int = 1024
    page_size: int = 16
    max_total_num_tokens: int = 65536
    context_length: int = 512
    max_running_requests: int = 256
    max_queued_requests: int | None = None
    probe_delay_at_capacity_ms: float = 0.0
    early_headers: bool = False
    realtime: bool = False
    fail_status: int = 503
    fail_every: int = 0
    die_after: int = 0
    tokenizer: str | None = None
    enable_prefix_caching: bool = False
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "mixed"):
            raise ValueError(f"role must be prefill, decode or mixed, not {self.role!r}")
        if min(self.ttft_ms, self.itl_ms, self.queue_ms, self.transfer_ms) < 0:
            raise ValueError("delays must be >= 0")
        if self.queue_ms + self.transfer_ms > self.ttft_ms:
            raise ValueError("queue_ms + transfer_ms must not exceed ttft_ms")


def parse_args(argv: list[str] | None = None) -> FakeServerConfig:
    p = argparse.ArgumentParser(prog="python -m pd_cluster.bench.fake_server", allow_abbrev=False,
                                description="A fast fake OpenAI-compatible worker with exact, known delays.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port (printed at start)")
    p.add_argument("--role", choices=("prefill", "decode", "mixed"), default="mixed")
    p.add_argument("--model", "--served-model-name", dest="model", default="stories260K")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--num-tokens", type=int, default=None, help="tokens before an emulated EOS")
    p.add_argument("--queue-ms", type=float, default=0.0, help="part of the TTFT spent queued")
    p.add_argument("--transfer-ms", type=float, default=0.0, help="part of the TTFT spent in KV transfer")
    p.add_argument("--kv-bytes-per-token", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-num-tokens", type=int, default=65536)
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="enforce --max-running-requests: this many wait, the rest get 503 overloaded")
    p.add_argument("--probe-delay-at-capacity-ms", type=float, default=0.0,
                   help="/health and /get_load answer this late while every slot is taken")
    p.add_argument("--early-headers", action="store_true", help="send headers on arrival (vLLM style)")
    p.add_argument("--fail-status", type=int, default=503)
    p.add_argument("--fail-every", type=int, default=0, help="fail every N-th OpenAI request (0: never)")
    p.add_argument("--die-after", type=int, default=0, help="exit mid-stream in the N-th request (0: never)")
    p.add_argument("--tokenizer", default=None, help="count prompt tokens with this tokenizer")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="emulate a prefix cache and export its counts (costs ~0.1 ms per 1,000-token prompt)")
    p.add_argument("--kv-events", action="store_true",
                   help="publish KV events and a text-to-page map of word tokens (GET /kv_events, /kv_text_map)")
    p.add_argument("--realtime", action="store_true", help="try SCHED_FIFO so timers fire on time")
    a = p.parse_args(argv)
    return FakeServerConfig(**{k: v for k, v in vars(a).items()})
