"""A huge prompt is refused before tokenization and never freezes the streams of other requests (issue 12 §2).

Before: a 25 MB prompt was tokenized on the event loop (33.5 s with every stream frozen). Now it is refused
by its size (a token covers at most N bytes) and any tokenization runs in a thread. The gap bound here is
loose (the machine is shared); `stall_probe.py` measures the gaps precisely.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bad_input_cases import assert_openai_error  # noqa: E402
from worker_kit import PROMPTS, running_worker  # noqa: E402

from pd_cluster.serving.tokenization import max_bytes_per_token  # noqa: E402

GAP_BOUND_S = 3.0


class Streamer(threading.Thread):
    """Streamed completions, one after another until `stop` is set; records when each token event arrived."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.runs: list[list[float]] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            for _ in range(50):  # bounded
                if self.stop.is_set():
                    return
                times: list[float] = []
                self.runs.append(times)
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            times.append(time.monotonic())
                assert len(times) == self.max_tokens, len(times)  # one event per token
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def events_between(self, a: float, b: float) -> int:
        return sum(a <= t <= b for ts in self.runs for t in ts)

    def max_gap(self, a: float, b: float) -> float:
        """The largest gap between consecutive token events of one request that ends inside [a, b]."""
        return max((y - x for ts in self.runs for x, y in zip(ts, ts[1:]) if a <= y and x <= b), default=0.0)


@pytest.fixture(scope="module")
def worker():
    with running_worker() as w:
        yield w


def test_bytes_per_token_bound(worker):
    tok = worker.engine.tokenizer
    n = max_bytes_per_token(tok)
    assert n is not None and n >= 4
    # the bound holds on real text: no token of these prompts covers more than n bytes
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False).input_ids
        assert len(p.encode()) <= n * len(ids)


def test_huge_prompt_refused_while_streams_keep_flowing(worker):
    streams = [Streamer(worker.url, p, 200) for p in PROMPTS[:4]]
    for s in streams:
        s.start()
    deadline = time.monotonic() + 60
    while any(sum(map(len, s.runs)) < 3 for s in streams) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(sum(map(len, s.runs)) >= 3 for s in streams), [s.error for s in streams]
    sent = time.monotonic()
    big = "Once upon a time " * 1_500_000  # 25.5 MB
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        r = c.post("/v1/completions", content=json.dumps({"prompt": big, "max_tokens": 4}).encode(),
                   headers={"Content-Type": "application/json"})
        err = assert_openai_error(r, 400, "prompt", "context_length_exceeded")
        assert "covers at most" in err["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": big[:5_000_000]}]})
        assert_openai_error(r, 400, "messages", "context_length_exceeded")
        # just over what the bound can refuse: tokenized (in the thread), then refused by its token count
        n = max_bytes_per_token(worker.engine.tokenizer)
        edge = "x" * (n * (worker.engine.context_length - 1))
        assert_openai_error(c.post("/v1/completions", json={"prompt": edge}), 400, "prompt",
                            "context_length_exceeded")
    done = time.monotonic()
    refused = done - sent
    for s in streams:
        s.stop.set()
    for s in streams:
        s.join(120)
        assert s.error is None, s.error
        assert s.events_between(sent, done) > 0  # it was streaming while the large prompts were refused
    gaps = [s.max_gap(sent, done) for s in streams]
    print(f"refused in {refused:.2f} s; largest gap per stream meanwhile: {[round(g, 3) for g in gaps]}")
    assert max(gaps) < GAP_BOUND_S, (gaps, refused)
    assert refused < 30, refused
