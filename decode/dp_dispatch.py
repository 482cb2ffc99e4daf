"""The front of a DP-attention decode instance: each OpenAI request goes to one DP rank's decode server.

A decode worker started with ``--tp-size N --dp-size N --enable-dp-attention`` is N DP rank processes
(`pd_cluster.decode.dp_instance`), each a whole decode server with its own engine, KV pool and transfer agent.
Rank 0's process serves the instance's URL; `DPDispatch`, an ASGI middleware on its app, picks each request's
rank (SGLang's ``data_parallel_rank`` in the body pins it; otherwise the rank with the fewest requests in flight
through this front, `pd_cluster.engine.executor.dp.pick_dp_rank`) and runs it on rank 0's own app or relays it,
byte for byte and streamed, to rank r's server. That rank's decode server then asks the prefill worker for the KV
with its own URL and ticket, so the prefill pushes the request's pages into that rank's pool only.

It also answers for the whole instance: ``/health`` is 200 only when every rank's is, and ``/get_load`` sums the
ranks' numbers (``token_usage``: the fullest rank's) and lists each rank's own under ``dp_ranks`` (as
`DPAttentionEngine.load`), ``/metrics`` is every rank's, each sample labelled ``dp_rank``
(`pd_cluster.decode.dp_metrics`), and ``/expert_distribution`` adds each rank's EPLB statistics under
``dp_ranks``. Every other path is rank 0's.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
from prometheus_client import CONTENT_TYPE_LATEST

from pd_cluster.decode.dp_metrics import merge_rank_metrics
from pd_cluster.engine.errors import RequestRejected
from pd_cluster.engine.executor.dp import pick_dp_rank
from pd_cluster.serving.body import MAX_BODY_BYTES
from pd_cluster.serving.errors import error_body

logger = logging.getLogger("pd.decode")

DISPATCHED = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
HOP_HEADERS = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"}
SUMMED = ("num_running_reqs", "num_queue_reqs", "num_free_pages", "num_evictable_pages", "num_total_pages",
          "max_running_requests", "num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs")
RANK_CHECK_TIMEOUT_S = 2.0  # a rank's /health or /get_load that does not answer by then counts as down


class DPDispatch:
    """ASGI middleware on DP rank 0's decode app (module docstring).

    Args:
        app: rank 0's app.
        urls: every rank's server URL in rank order (rank 0's own entry is not used).
    """

    def __init__(self, app, urls: list[str]) -> None:
        self.app = app
        self.urls = list(urls)
        self.in_flight = [0] * len(urls)  # requests of each rank this front has not finished relaying
        self.dispatched = [0] * len(urls)  # requests sent to each rank so far
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                            keepalive_expiry=2.0))
        # the router polls /get_load and /health every 100 ms: the front's calls to the ranks are not worth a log line
        polls = tuple(f"{u}{path}" for u in self.urls[1:] for path in ("/get_load", "/health"))
        logging.getLogger("httpx").addFilter(lambda record: not any(p in record.getMessage() for p in polls))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method")
        if method == "POST" and path in DISPATCHED:
            return await self._dispatch(scope, receive, send)
        if method == "GET" and path == "/get_load":
            return await self._load(scope, send)
        if method == "GET" and path == "/health":
            return await self._health(scope, send)
        if method == "GET" and path == "/metrics":
            return await self._metrics(scope, send)
        if method == "GET" and path == "/expert_distribution":
            return await self._expert_distribution(scope, send)
        return await self.app(scope, receive, send)

    # ---- requests -------------------------------------------------------------------------------------
    async def _dispatch(self, scope, receive, send) -> None:
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > MAX_BODY_BYTES:  # the rank's own app answers the 413: hand it what was read
                more = False
        try:
            obj = json.loads(body)
        except ValueError:  # the rank's app answers the 400
            obj = None
        pinned = obj.pop("data_parallel_rank", None) if isinstance(obj, dict) else None
        try:
            rank = pick_dp_rank(self.in_flight, pinned)
        except RequestRejected as e:
            return await _json(send, 400, error_body(400, str(e), "data_parallel_rank", "invalid_dp_rank"))
        if isinstance(obj, dict) and pinned is not None:
            body = json.dumps(obj).encode()
        self.in_flight[rank] += 1
        self.dispatched[rank] += 1
        try:
            if rank == 0:
                await self.app(_with_body(scope, body), _replay(body, receive), send)
            else:
                await self._relay(rank, scope, body, receive, send)
        finally:
            self.in_flight[rank] -= 1

    async def _relay(self, rank: int, scope, body: bytes, receive, send) -> None:
        """Send the request to rank `rank`'s server and its answer back as it comes; a client that goes away closes
        the rank's connection (the rank's server aborts the request)."""
        query = scope.get("query_string", b"").decode("latin-1")
        url = self.urls[rank] + scope["path"] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in HOP_HEADERS]
        try:
            resp = await self.client.send(self.client.build_request("POST", url, headers=headers, content=body),
                                          stream=True)
        except httpx.HTTPError as e:
            logger.error("DP rank %d (%s) unreachable: %r", rank, self.urls[rank], e)
            return await _json(send, 502, error_body(502, f"DP rank {rank} of this decode instance is unreachable: "
                                                          f"{e!r}", None, "dp_rank_unreachable"))
        relay = asyncio.ensure_future(_copy(resp, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone):
                task.cancel()
            await resp.aclose()
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()

    # ---- the instance's state -----------------------------------------------------------------------------
    async def _rank_json(self, scope, path: str) -> list[tuple[int, dict]]:
        """Every rank's answer to GET `path` as (status, JSON body), rank 0's from its app, in rank order."""
        async def one(rank: int) -> tuple[int, dict]:
            if rank == 0:
                return await _call_app(self.app, scope)
            try:
                r = await self.client.get(self.urls[rank] + path, timeout=RANK_CHECK_TIMEOUT_S)
                return r.status_code, r.json()
            except (httpx.HTTPError, ValueError) as e:
                return 503, {"error": {"message": f"DP rank {rank} did not answer {path}: {e!r}"}}

        return list(await asyncio.gather(*(one(r) for r in range(len(self.urls)))))

    async def _health(self, scope, send) -> None:
        answers = await self._rank_json(scope, "/health")
        bad = [(r, s, b) for r, (s, b) in enumerate(answers) if s != 200]
        if not bad:
            return await _json(send, 200, answers[0][1])
        rank, status, body = bad[0]
        return await _json(send, 503 if status == 200 else status, dict(body, dp_rank=rank))

    async def _load(self, scope, send) -> None:
        answers = await self._rank_json(scope, "/get_load")
        loads = [b for s, b in answers]
        if any(s != 200 for s, _ in answers):
            return await _json(send, 503, next(b for s, b in answers if s != 200))
        out = dict(loads[0])
        for key in SUMMED:
            if all(isinstance(ld.get(key), int) for ld in loads):
                out[key] = sum(ld[key] for ld in loads)
        out["token_usage"] = max(float(ld.get("token_usage", 0.0)) for ld in loads)
        out["dp_size"] = len(loads)
        out["dp_ranks"] = [dict(ld, dp_rank=r, in_flight=self.in_flight[r], dispatched=self.dispatched[r])
                           for r, ld in enumerate(loads)]
        return await _json(send, 200, out)


    async def _expert_distribution(self, scope, send) -> None:
        """Rank 0's EPLB statistics (the placement every rank shares) and each rank's own under ``dp_ranks``
        (its tokens' expert load)."""
        answers = await self._rank_json(scope, "/expert_distribution")
        if any(s != 200 for s, _ in answers):
            return await _json(send, 503, next(b for s, b in answers if s != 200))
        return await _json(send, 200, dict(answers[0][1], dp_ranks=[dict(b, dp_rank=r)
                                                                    for r, (_, b) in enumerate(answers)]))

    async def _metrics(self, scope, send) -> None:
        """Every rank's metrics in one exposition, each sample labelled ``dp_rank`` (`merge_rank_metrics`); a rank
        that does not answer is left out (its ``/health`` says so)."""
        async def one(rank: int) -> str | None:
            if rank == 0:
                status, body = await _call_app_raw(self.app, scope)
                return body.decode() if status == 200 else None
            try:
                r = await self.client.get(self.urls[rank] + "/metrics", timeout=RANK_CHECK_TIMEOUT_S)
                return r.text if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        data = merge_rank_metrics(list(await asyncio.gather(*(one(r) for r in range(len(self.urls))))))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data, "more_body": False})


def _with_body(scope, body: bytes) -> dict:
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    return dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])


def _replay(body: bytes, receive):
    """A `receive` that gives `body` once, then the client's own messages (its disconnect)."""
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _copy(resp: httpx.Response, send) -> None:
    await send({"type": "http.response.start", "status": resp.status_code,
                "headers": [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP_HEADERS - {b"content-length"}]})
    async for chunk in resp.aiter_raw():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _call_app(app, scope) -> tuple[int, dict]:
    """GET `scope`'s path on `app` in-process: (status, JSON body)."""
    status, body = await _call_app_raw(app, scope)
    try:
        return status, json.loads(body or b"{}")
    except ValueError:
        return status, {}


async def _call_app_raw(app, scope) -> tuple[int, bytes]:
    """GET `scope`'s path on `app` in-process: (status, body bytes)."""
    status, chunks = 500, []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def _json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
