"""A fast fake OpenAI-compatible worker with exact, known delays.

Run it as ``python -m pd_cluster.bench.fake_server --port 8100 --ttft-ms 50 --itl-ms 10 --num-tokens 20``.
It speaks the worker contract of ``docs/worker-api.md``: ``/v1/completions`` and
``/v1/chat/completions`` (SSE streaming ending in ``data: [DONE]``, or one JSON
body with ``usage``), ``/v1/models``, ``/health``, ``/get_load``, ``/server_info``
and ``/metrics`` (``pd:`` names, measured on the fake itself), plus
``GET /debug/requests`` listing recent requests and the headers they carried, and
``GET /debug/timers``: how late its own delays fired (p50/p99/max, ms); the
routes beside the OpenAI API are ``bench/fake_endpoints.py``'s.

Timing: token ``i`` (0-based) of a request is written at
``arrival + ttft + i * itl`` on the monotonic clock, each against its own
deadline, so errors do not accumulate; the event loop's timers have
microsecond resolution (``pd_cluster.bench.precise_loop``). The time to first token is split into
emulated phases: ``--queue-ms`` waiting, then prefill, then ``--transfer-ms``
of KV transfer (prefill gets the rest). As the contract says, the status line
and headers go out with the first token (``--early-headers`` sends them, and the
chat role chunk, on arrival instead, as vLLM does).

The number of tokens is ``min(max_tokens, --num-tokens)`` (``finish_reason``
``stop`` when ``--num-tokens`` ends it first, as an EOS would); with
``ignore_eos`` it is ``max_tokens``. Prompt tokens are counted with
``--tokenizer`` when given, else as whitespace-separated words; with
``--enable-prefix-caching`` the same units feed an emulated prefix cache
(``bench/fake_cache.py``) whose counts are exported. ``--kv-events`` publishes
KV events and a text-to-page map as a real worker does (``bench/fake_kv.py``).

Under CPU contention the fake's own timers fire late; ``--realtime`` asks the
OS for ``SCHED_FIFO`` scheduling (Linux, needs CAP_SYS_NICE; it says whether it
got it) so the delays stay exact on a busy machine.

Fault injection: ``--fail-status 503 --fail-every N`` answers every N-th OpenAI
request with that status and an OpenAI error body; ``--die-after N`` makes the
process exit abruptly half-way through streaming the N-th request.

Capacity: with ``--max-queued-requests N`` at most ``--max-running-requests``
requests run at once, N more wait (their TTFT counts from admission), and the
rest are refused with 503 ``overloaded`` and ``Retry-After: 1``
(``bench/fake_capacity.py``); ``--probe-delay-at-capacity-ms D`` makes
``/health`` and ``/get_load`` answer D ms late while every slot is taken, as a
worker whose HTTP loop lags behind a full batch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
import uuid
from collections import deque
from typing import Any, Callable

from pd_cluster.bench.fake_cache import FakePrefixCache
from pd_cluster.bench.fake_capacity import FakeCapacity
from pd_cluster.bench.fake_config import FakeServerConfig, parse_args
from pd_cluster.bench.fake_endpoints import FakeEndpoints
from pd_cluster.bench.fake_format import JSON, ChunkFormat, ClientError, Job, send_error, send_json
from pd_cluster.bench.fake_kv import FakeKv
from pd_cluster.bench.fake_metrics import FakeMetrics
from pd_cluster.bench.httpserver import HttpServer, Request, Responder
from pd_cluster.bench.precise_loop import new_event_loop

SSE = ("content-type", "text/event-stream")
WORDS = (" Once", " upon", " a", " time", " there", " was", " little", " girl")


class FakeServer(FakeEndpoints):
    """The request handler and state of one fake worker (its routes beside the OpenAI API: `FakeEndpoints`).

    ``on_die`` is called by ``--die-after``; the command line passes ``os._exit``.
    """

    def __init__(self, config: FakeServerConfig, on_die: Callable[[], None] | None = None) -> None:
        self.config = config
        self.metrics = FakeMetrics(config.max_total_num_tokens, config.enable_prefix_caching)
        self.recent: deque[dict[str, Any]] = deque(maxlen=1024)
        self.timer_lateness: deque[float] = deque(maxlen=100_000)
        self.incarnation = uuid.uuid4().hex[:12]
        self._on_die = on_die
        self._ids = itertools.count(1)
        self._num_openai = 0
        self._running = 0
        self._queued = 0
        self.capacity = FakeCapacity(config.max_running_requests, config.max_queued_requests) \
            if config.max_queued_requests is not None else None
        self._transferring = 0
        self._used_pages = 0
        self._generated_total = 0
        self._total_pages = config.max_total_num_tokens // config.page_size
        self._tokenizer = _load_tokenizer(config.tokenizer)
        self.prefix_cache = FakePrefixCache(config.page_size) if config.enable_prefix_caching else None
        self.kv = FakeKv(config.page_size, self._total_pages) if config.kv_events else None
        m = self.metrics
        m.num_running_reqs.set_function(lambda: self._running)
        m.num_queue_reqs.set_function(lambda: self._queued)
        m.decode_transfer.set_function(lambda: self._transferring)
        m.token_usage.set_function(self.token_usage)
        self._routes = {
            ("POST", "/v1/completions"): self._openai,
            ("POST", "/v1/chat/completions"): self._openai,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/get_load"): self._get_load,
            ("GET", "/server_info"): self._server_info,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/debug/requests"): self._debug_requests,
            ("GET", "/debug/timers"): self._debug_timers,
        }
        if self.kv is not None:
            kv = self.kv
            self._routes[("GET", "/kv_events")] = lambda req, resp: send_json(resp, kv.kv_events(req.query))
            self._routes[("GET", "/kv_text_map")] = lambda req, resp: send_json(resp, kv.kv_text_map(req.query))

    def token_usage(self) -> float:
        return self._used_pages / self._total_pages if self._total_pages else 0.0

    async def handle(self, req: Request, resp: Responder) -> None:
        route = self._routes.get((req.method, req.path))
        if route is None:
            send_error(resp, 404, f"Invalid URL ({req.method} {req.path})", "unknown_url", [])
            return
        await route(req, resp)

    async def _sleep_until(self, deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        self.timer_lateness.append(max(0.0, time.monotonic() - deadline))

    # OpenAI endpoints --------------------------------------------------------------------
    async def _openai(self, req: Request, resp: Responder) -> None:
        c = self.config
        rid = req.headers.get("x-request-id") or f"cmpl-{self.incarnation}-{next(self._ids)}"
        hdrs = [("x-request-id", rid)]
        entry = {"request_id": rid, "path": req.path, "arrival": req.arrival, "headers": req.headers}
        self.recent.append(entry)
        if c.role == "prefill":
            entry["status"] = 404
            send_error(resp, 404, "a prefill worker serves no OpenAI API", "unknown_url", hdrs)
            return
        self._num_openai += 1
        number = self._num_openai
        if c.fail_every and number % c.fail_every == 0:
            entry["status"] = c.fail_status
            send_error(resp, c.fail_status, f"injected failure (request {number})", "injected_failure", hdrs)
            return
        try:
            job = self._parse(req, rid)
        except ClientError as exc:
            entry["status"] = exc.status
            send_error(resp, exc.status, str(exc), exc.code, hdrs, exc.param)
            return
        if self.capacity is not None:
            if not await self.capacity.admit():
                entry["status"] = 503
                send_error(resp, 503, "the admission queue is full", "overloaded", hdrs + [("retry-after", "1")])
                return
            req.arrival = time.monotonic()  # its TTFT counts from admission
        entry["status"] = 200
        die_at = job.n_tokens // 2 if c.die_after and number == c.die_after else -1
        self._running += 1
        self._take_pages(job, job.prompt_tokens)
        try:
            await self._generate(req, resp, job, hdrs, die_at, entry)
        finally:
            self._running -= 1
            self._used_pages -= job.pages
            if self.capacity is not None:
                self.capacity.release()

    def _parse(self, req: Request, rid: str) -> Job:
        try:
            body = json.loads(req.body)
        except ValueError:
            raise ClientError(400, "malformed JSON body", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ClientError(400, "the body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise ClientError(404, f"the model `{model}` does not exist", "model", "model_not_found")
        chat = req.path == "/v1/chat/completions"
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ClientError(400, "messages must be a non-empty list", "messages")
            prompt: Any = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        else:
            prompt = body.get("prompt")
            if prompt is None:
                raise ClientError(400, "prompt is required", "prompt", "missing_required_parameter")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ClientError(400, "max_tokens must be a positive integer", "max_tokens")
        n, reason = self._num_output(max_tokens, bool(body.get("ignore_eos")))
        opts = body.get("stream_options") or {}
        units = self._prompt_units(prompt)
        if self.kv is not None:
            self.kv.observe(body, chat)
        if self.prefix_cache is not None:
            self.metrics.observe_prefix_cache(len(units), self.prefix_cache.lookup_and_insert(units))
        return Job(rid, chat, bool(body.get("stream")), bool(opts.get("include_usage")), len(units), n, reason)

    def _num_output(self, max_tokens: int | None, ignore_eos: bool) -> tuple[int, str]:
        eos_at = self.config.num_tokens
        if max_tokens is None:
            return (eos_at, "stop") if eos_at is not None else (16, "length")
        if eos_at is None or ignore_eos or max_tokens <= eos_at:
            return max_tokens, "length"
        return eos_at, "stop"

    def _prompt_units(self, prompt: Any) -> list:
        """The prompt's tokens as the fake counts them: ids, else the tokenizer's ids, else words."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        if self._tokenizer is not None:
            return list(self._tokenizer.encode(text, add_special_tokens=True))
        return text.split()

    def _take_pages(self, job: Job, tokens: int) -> None:
        need = -(-tokens // self.config.page_size)
        if need > job.pages:
            self._used_pages += need - job.pages
            job.pages = need

    async def _generate(self, req: Request, resp: Responder, job: Job, hdrs: list, die_at: int,
                        entry: dict[str, Any]) -> None:
        c, m, t0 = self.config, self.metrics, req.arrival
        fmt = ChunkFormat(job, c.model)
        headers = hdrs + [SSE, ("cache-control", "no-cache")] if job.stream else hdrs + [JSON]
        if job.stream and c.early_headers:
            resp.start_stream(200, headers, fmt.role_chunk())
        await self._phases(job, t0)
        pieces: list[str] = []
        first = last = t0
        for i in range(job.n_tokens):
            await self._sleep_until(t0 + (c.ttft_ms + i * c.itl_ms) / 1000.0)
            if resp.closed:
                return
            now = time.monotonic()
            if i == 0:
                first = entry["first_token"] = now
                m.ttft.observe(now - t0)
            else:
                m.itl.observe(now - last)
            last = now
            word = WORDS[i % len(WORDS)]
            job.generated += 1
            self._generated_total += 1
            self._take_pages(job, job.prompt_tokens + job.generated)
            if job.stream:
                data = fmt.token_chunk(word)
                if resp.started:
                    resp.write(data)
                else:
                    resp.start_stream(200, headers, fmt.role_chunk() + data)
            else:
                pieces.append(word)
            if i == die_at and self._on_die is not None:
                self._on_die()
                return
        entry["last_token"] = last
        self._finish(resp, job, fmt, headers, "".join(pieces), t0, last - first)

    async def _phases(self, job: Job, t0: float) -> None:
        """Emulated queue, prefill and KV transfer phases; each measured as it ran."""
        c, m = self.config, self.metrics
        q_end = t0 + c.queue_ms / 1000.0
        p_end = t0 + (c.ttft_ms - c.transfer_ms) / 1000.0
        self._queued += 1
        await self._sleep_until(q_end)
        self._queued -= 1
        t_admit = time.monotonic()
        m.queue_time.observe(t_admit - t0)
        await self._sleep_until(p_end)
        t_prefilled = time.monotonic()
        m.prefill_time.observe(t_prefilled - t_admit)
        m.prompt_tokens.inc(job.prompt_tokens)
        if c.transfer_ms > 0:
            self._transferring += 1
            await self._sleep_until(t0 + c.ttft_ms / 1000.0)
            self._transferring -= 1
            took = time.monotonic() - t_prefilled
            m.transfer_time.observe(took)
            nbytes = job.prompt_tokens * c.kv_bytes_per_token
            m.observe_transfer(nbytes, took, max(1, -(-job.prompt_tokens // c.page_size)))

    def _finish(self, resp: Responder, job: Job, fmt: "ChunkFormat", headers: list,
                text: str, t0: float, decode_s: float) -> None:
        m = self.metrics
        m.e2e.observe(time.monotonic() - t0)
        m.decode_time.observe(decode_s)
        m.generation_tokens.inc(job.n_tokens)
        m.request_success.labels(finished_reason=job.finish_reason).inc()
        if job.stream:
            tail = fmt.final_chunk() + (fmt.usage_chunk() if job.include_usage else b"") + b"data: [DONE]\n\n"
            if resp.started:
                resp.end_stream(tail)
            else:
                resp.start_stream(200, headers, fmt.role_chunk() + tail)
                resp.end_stream()
        else:
            resp.send(200, fmt.full_body(text), headers)


def _load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def set_realtime() -> str:
    """Switch this process to ``SCHED_FIFO`` priority 1; returns what happened, in words."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "SCHED_FIFO"
    except (AttributeError, OSError) as exc:
        return f"normal scheduling ({type(exc).__name__}: {exc})"


async def serve(config: FakeServerConfig, on_die: Callable[[], None] | None = None) -> None:
    """Run a fake server until cancelled; prints ``listening on http://HOST:PORT`` once bound."""
    server = FakeServer(config, on_die)
    http = HttpServer(server.handle, config.host, config.port)
    await http.start()
    if config.realtime:
        print(f"fake OpenAI server scheduling: {set_realtime()}", flush=True)
    print(f"fake OpenAI server ({config.role}) listening on http://{config.host}:{http.port}", flush=True)
    try:
        await http.serve_forever()
    finally:
        await http.close()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        with asyncio.Runner(loop_factory=lambda: new_event_loop()[0]) as runner:
            runner.run(serve(config, on_die=lambda: os._exit(1)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
