"""The decode worker's `PromptSource`: the prompt is prefilled by a prefill worker and its KV pushed here.

Per request: load the prefill agent's metadata (cached per incarnation; the
handshake checks layouts), queue the request until its prompt pages are
reserved, send the job with the ticket to ``POST {prefill}/prefill``, and
wait until every push has arrived (the receiver's poll) or something fails.
Failures before the first token raise `HTTPError` (502, 504; 409 from a stale
prefill incarnation is retried once with fresh metadata), so the router can
retry on another pair. A client that goes away aborts the request here and at
the prefill worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import httpx

from pd_cluster.decode.handover import DecodeHooks, Handover
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.serving.engine_loop import EngineLoop
from pd_cluster.serving.errors import HTTPError, to_http_error, transfer_http_error
from pd_cluster.serving.openai_serving import PromptSource
from pd_cluster.transfer.errors import TransferError
from pd_cluster.transfer.http import PeerDirectory, apply

logger = logging.getLogger("pd.decode")

PREFILL_HEADER = "x-pd-prefill-url"


class _StalePrefill(Exception):
    """The prefill worker restarted since its metadata was cached."""


class RemotePrefill(PromptSource):
    """Prefill on a remote worker, KV over NIXL.

    Args:
        loop: the engine loop (decode role).
        hooks: the decode hooks in that loop.
        agent: this worker's transfer agent (a `TransferAgent`, or a `transfer.tp.TPAgent` under TP).
        directory: peers' metadata cache.
        self_url: this worker's URL (prefill fetches our metadata from it).
        default_prefill_url: used when a request names none (``--prefill-url``).
        http_timeout: seconds for the whole ``/prefill`` call (queueing and prefill included).
    """

    def __init__(self, loop: EngineLoop, hooks: DecodeHooks, agent, directory: PeerDirectory,
                 self_url: str, default_prefill_url: str | None = None, http_timeout: float = 600.0) -> None:
        self.loop = loop
        self.hooks = hooks
        self.agent = agent
        self.directory = directory
        self.self_url = self_url
        self.default_prefill_url = default_prefill_url
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(http_timeout, connect=5.0))
        self._prefill_of: dict[str, str] = {}

    async def close(self) -> None:
        await self.client.aclose()

    async def start(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    headers: dict[str, str]) -> asyncio.Queue:
        url = headers.get(PREFILL_HEADER) or self.default_prefill_url
        if not url:
            raise HTTPError(400, "a decode worker needs the prefill worker: set the X-PD-Prefill-Url header "
                                 "(the router does) or --prefill-url", None, "missing_prefill")
        for attempt in range(2):
            try:
                return await self._attempt(request_id, prompt_ids, params, url.rstrip("/"))
            except _StalePrefill:
                self.directory.invalidate(url)
                logger.info("request %s: prefill %s restarted; refreshing its metadata (attempt %d)",
                            request_id, url, attempt + 1)
        raise HTTPError(502, f"prefill worker {url} kept refusing our tickets as stale", None, "stale_peer")

    async def _attempt(self, request_id: str, prompt_ids: list[int], params: SamplingParams, url: str):
        try:
            resolved = await self.directory.aresolve(url, client=self.client)
            if resolved.fetched or not self.agent.is_connected(resolved.info.agent_name):
                await self.loop.call(lambda e: apply(self.agent, resolved))
        except TransferError as e:  # our own handshake refused the prefill worker: a bad pair, 502 for the router
            err = transfer_http_error(e)
            raise HTTPError(502 if err.status < 500 else err.status, err.message, None, err.code) from e
        aloop = asyncio.get_running_loop()
        h = Handover(request_id, resolved.info.agent_name, aloop.create_future(), aloop.create_future(), aloop)
        stream = self.loop.open_stream(request_id)
        self._prefill_of[request_id] = url
        post: asyncio.Future | None = None
        try:
            await self.loop.call(lambda e: self.hooks.register(e, h, prompt_ids, params, stream=True))
            ticket = await h.ticket_future
            post = asyncio.ensure_future(self._post(url, request_id, prompt_ids, params, ticket))
            done, _ = await asyncio.wait({h.kv_future, post}, return_when=asyncio.FIRST_COMPLETED)
            if h.kv_future not in done:
                await self._check_prefill_answer(request_id, post)
            await h.kv_future  # raises the transfer's error
            post.add_done_callback(lambda f: self._on_prefill_answer(request_id, f))
            return stream
        except _StalePrefill:
            self.loop.close_stream(request_id)
            raise
        except BaseException as e:
            self.loop.close_stream(request_id)
            if isinstance(e, asyncio.CancelledError):
                self.abort(request_id)
            if post is not None and not post.done():
                post.cancel()
            if isinstance(e, TransferError):
                raise transfer_http_error(e) from e
            raise
        finally:
            if post is None or post.done():
                self._prefill_of.pop(request_id, None)

    async def _post(self, url: str, request_id: str, prompt_ids: list[int], params: SamplingParams, ticket):
        body = {"request_id": request_id, "prompt_token_ids": prompt_ids, "decode_url": self.self_url,
                "ticket": ticket.to_dict(), "sampling": _first_token_params(params)}
        return await self.client.post(f"{url}/prefill", json=body, headers={"X-Request-Id": request_id})

    async def _check_prefill_answer(self, request_id: str, post: asyncio.Future) -> None:
        """The prefill call ended before the KV was complete: an error unless it said OK."""
        try:
            resp = post.result()
        except httpx.HTTPError as e:
            msg = f"prefill worker unreachable or died: {e!r}"
            self.loop.call_soon(lambda eng: self.hooks.fail(eng, request_id, msg, peer_gone=True))
            raise HTTPError(502, msg, None, "prefill_unreachable") from e
        if resp.status_code == 200:
            self._record_timings(request_id, resp)
            return
        err = _error_of(resp)
        if err.status in (400, 409):  # refused before any push: the pages are free at once
            self.loop.call_soon(lambda eng: self.hooks.withdraw(eng, request_id))
            if err.code == "stale_peer":
                raise _StalePrefill()
            if err.status == 400:
                raise err
        else:
            self.loop.call_soon(lambda eng: self.hooks.fail(eng, request_id, err.message, peer_gone=False))
        raise HTTPError(504 if err.status == 504 else 502, f"prefill failed: {err.message}", None, err.code)

    def _on_prefill_answer(self, request_id: str, f: asyncio.Future) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        resp = f.result()
        if resp.status_code == 200:
            self._record_timings(request_id, resp)

    def _record_timings(self, request_id: str, resp: httpx.Response) -> None:
        timings = resp.json().get("timings", {})

        def record(engine):
            req = engine.requests.get(request_id)
            if req is not None:
                req.times.remote_queue_s = timings.get("queue_s")
                req.times.remote_prefill_s = timings.get("prefill_s")

        self.loop.call_soon(record)

    def abort(self, request_id: str) -> None:
        self.loop.close_stream(request_id)
        self.loop.call_soon(lambda e: self.hooks.abort(e, request_id, "the client went away"))
        url = self._prefill_of.pop(request_id, None)
        if url is not None:
            asyncio.ensure_future(self._post_abort(url, request_id))

    async def _post_abort(self, url: str, request_id: str) -> None:
        try:
            await self.client.post(f"{url}/abort", json={"request_id": request_id}, timeout=2.0)
        except httpx.HTTPError as e:
            logger.info("request %s: could not tell prefill %s to abort: %r", request_id, url, e)


def _first_token_params(params: SamplingParams) -> dict:
    """What the prefill worker needs to sample the first token exactly as a mixed worker would."""
    d = dataclasses.asdict(params)
    d["max_tokens"] = 1
    d["min_tokens"] = min(params.min_tokens, 1)
    d["stop"] = None
    return d


def _error_of(resp: httpx.Response) -> HTTPError:
    try:
        e = resp.json()["error"]
        return HTTPError(resp.status_code, e.get("message", resp.text), e.get("param"), e.get("code"))
    except (ValueError, KeyError, TypeError):
        return to_http_error(RuntimeError(f"prefill answered HTTP {resp.status_code}: {resp.text[:200]}"))
