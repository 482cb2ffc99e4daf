"""The cluster-wide KV store as the prefix cache's third tier (SGLang's HiCache L3): write-through, prefetch on
arrival, load at admission.

**Write.** The tier observes the prefix cache (next to the KV event log): every chain of pages the cache stores
is named by its prefix digests (`keys.prefix_digests`), its bytes are copied out of the pool at once (the page
may be evicted and reused right after), and an I/O thread encodes and stores them (`keys.encode_page`). Pages the
tier loaded from the store, or wrote recently, are not written again. Writing on store rather than on eviction
(write-through) makes a prefix visible to every worker as soon as one computed it; measured against write-back
in ``docs/perf/kv-store.md``. A full write queue (``MAX_PENDING_BYTES``) drops the newest writes (counted).

**Read.** When a request arrives, the engine asks `prefetch`: the pages of its prompt past the longest prefix
this worker's cache holds (device or host) are looked up by key and read, on another I/O thread, into host
memory. The request joins the scheduler's queue once that is done, or after ``--hicache-storage-prefetch-timeout``
(``timeout`` policy, the default), at once with the pages ready by then (``best_effort``), or only when done
(``wait_complete``). At admission `take` hands the pages to the prefix cache (`PrefixCache.load_pages`), which
copies them into device pages and serves them as a hit. Every page read is checked (`keys.decode_page`); the
first bad one ends the hit there (it and the pages after it are recomputed) and is removed from the store.

**Faults.** A call that fails marks the store unavailable: prefetches stop at once (the request goes on without
the store), writes are dropped, and a thread tries `reconnect` every ``RECONNECT_SECS`` until the store answers.
Nothing in the step loop waits on the store.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pd_cluster.engine.kv.events import ROOT_HASH, page_hash
from pd_cluster.engine.kv.l3.backends import StorageBackend, StoreUnavailable
from pd_cluster.engine.kv.l3.keys import DIGEST_SIZE, BadPage, PageNamespace, decode_page, encode_page
from pd_cluster.engine.kv.l3.stats import L3Stats

logger = logging.getLogger("engine")

MAX_PENDING_BYTES = 256 * 1024 * 1024
RECONNECT_SECS = 2.0
KNOWN_PAGES = 1 << 17
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass
class Prefetch:
    """One request's read: pages ``[start, start + len(payloads))`` of its prompt, once `future` is done."""

    req: object
    start: int
    deadline: float
    future: Future
    payloads: list[torch.Tensor] = field(default_factory=list)


class L3Tier:
    """The store tier of one engine (module docstring).

    Args:
        backend: the store.
        namespace: what every key of this engine carries (model, dtype, page size, layout, format).
        pool_kv: the pool's tensor ``[num_pages + 1, *page_shape]``; pages are read from and written to it.
        page_size: tokens per page.
        prefetch_policy: `PREFETCH_POLICIES`.
        prefetch_timeout: seconds a request waits for its read (``timeout`` policy, and the bound of
            ``wait_complete``: a store that never answers cannot hold a request forever).
        on_written: called from the write thread with the 64-bit event hashes of pages stored (the worker's
            KV events tell the router, `KVEventLog.l3_stored`).
    """

    def __init__(self, backend: StorageBackend, namespace: PageNamespace, pool_kv: torch.Tensor, page_size: int,
                 prefetch_policy: str = "timeout", prefetch_timeout: float = 1.0, on_written=None) -> None:
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy must be one of {PREFETCH_POLICIES}, got {prefetch_policy!r}")
        self.backend = backend
        self.namespace = namespace
        self.pool_kv = pool_kv
        self.page_size = page_size
        self.page_nbytes = pool_kv[0].numel() * pool_kv.element_size()
        self.policy = prefetch_policy
        self.timeout = prefetch_timeout if prefetch_policy != "wait_complete" else max(prefetch_timeout, 30.0)
        self.on_written = on_written
        self.stats = L3Stats()
        self.available = True
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pages: dict[int, tuple[int, int]] = {}  # device page -> (prefix digest, event hash)
        self._known: OrderedDict[int, None] = OrderedDict()  # digests stored or read lately (not written again)
        self._pending: OrderedDict[str, Prefetch] = OrderedDict()  # request id -> its read, arrival order
        self._ready: dict[str, Prefetch] = {}  # read, waiting for admission
        self._writes: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._closed = threading.Event()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l3-read")
        self._writer = threading.Thread(target=self._write_loop, name="l3-write", daemon=True)
        self._writer.start()
        self._health = threading.Thread(target=self._health_loop, name="l3-health", daemon=True)
        self._health.start()

    # ---- the cache's observer (engine thread) ------------------------------------------------------------
    def stored(self, parent_page: int | None, pages: Sequence[int], tokens: Sequence[tuple[int, ...]]) -> None:
        """`pages` joined the device cache under `parent_page`: name them, and write those not stored yet."""
        if not pages:
            return
        if parent_page is None:
            digest, event = 0, ROOT_HASH
        else:
            known = self._pages.get(parent_page)
            if known is None:
                return  # under a page this tier never named (cannot happen with one KV group)
            digest, event = known
        todo: list[tuple[int, int, tuple[int, ...], int]] = []
        for page, toks in zip(pages, tokens):
            digest = page_hash(digest, toks, DIGEST_SIZE)
            event = page_hash(event, toks)
            self._pages[page] = (digest, event)
            if digest not in self._known:  # a stale answer only writes a page twice
                todo.append((page, digest, toks, event))
        if todo and self.available:
            self._queue_write(todo)

    def removed(self, pages: Sequence[int]) -> None:
        for p in pages:
            self._pages.pop(p, None)

    def _remember(self, digests: Sequence[int]) -> None:
        with self._lock:
            known = self._known
            for d in digests:
                known[d] = None
                known.move_to_end(d)
            while len(known) > KNOWN_PAGES:
                known.popitem(last=False)

    def _queue_write(self, todo: list[tuple[int, int, tuple[int, ...], int]]) -> None:
        nbytes = len(todo) * self.page_nbytes
        if self._queued_bytes + nbytes > MAX_PENDING_BYTES:
            self.stats.write_dropped_pages += len(todo)
            return
        data = self.pool_kv[torch.tensor([t[0] for t in todo], dtype=torch.long)].to("cpu")  # a copy
        with self._lock:
            self._queued_bytes += nbytes
        self._remember([t[1] for t in todo])
        self._writes.put(([(d, toks, ev) for _, d, toks, ev in todo], data, nbytes))

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                return
            items, data, nbytes = job
            try:
                if self.available:
                    self._write(items, data)
                else:
                    self.stats.write_dropped_pages += len(items)
            except Exception:  # noqa: BLE001 - a bug here must not stop later writes
                logger.exception("writing pages to the KV store failed")
            finally:
                with self._lock:
                    self._queued_bytes -= nbytes

    def _write(self, items, data: torch.Tensor) -> None:
        ns, raw = self.namespace, data.view(data.shape[0], -1).view(torch.uint8).numpy()
        encoded = [(ns.key(d), encode_page(ns.key(d), toks, raw[i].tobytes())) for i, (d, toks, _) in enumerate(items)]
        started = time.perf_counter()
        try:
            stored = self.backend.put(encoded)
        except StoreUnavailable as e:
            self._lost(e)
            self.stats.write_dropped_pages += len(items)
            return
        self.stats.on_write(len(items), stored, sum(len(v) for _, v in encoded), time.perf_counter() - started)
        if self.on_written is not None and stored:
            self.on_written([ev for _, _, ev in items])

    # ---- reads --------------------------------------------------------------------------------------------
    def prefetch(self, req, token_ids: Sequence[int], cached_pages: int) -> bool:
        """Start reading the pages of `req`'s prompt past its first `cached_pages` (engine thread).

        Returns False when there is nothing to read (the caller queues the request at once); else the request
        comes back from `ready`.
        """
        num_pages = (len(token_ids) - 1) // self.page_size  # the last token is always computed
        if not self.available or cached_pages >= num_pages:
            return False
        ids = list(token_ids[:num_pages * self.page_size])
        future = self._reader.submit(self._read, ids, cached_pages, num_pages)
        p = Prefetch(req, cached_pages, time.monotonic() + self.timeout, future)
        with self._lock:
            self._pending[req.request_id] = p
        future.add_done_callback(lambda _f: self._notify())
        self.stats.prefetches += 1
        return True

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _read(self, ids: list[int], start: int, num_pages: int) -> list[torch.Tensor]:
        ps, ns = self.page_size, self.namespace
        digests, parent = [], 0
        for i in range(num_pages):
            parent = page_hash(parent, ids[i * ps:(i + 1) * ps], DIGEST_SIZE)
            digests.append(parent)
        keys = [ns.key(d) for d in digests[start:]]
        started = time.perf_counter()
        try:
            found = self.backend.exists(keys)
            n = next((i for i, f in enumerate(found) if not f), len(found))
            values = self.backend.get(keys[:n]) if n else []
        except StoreUnavailable as e:
            self._lost(e)
            return []
        out: list[torch.Tensor] = []
        nbytes = 0
        for i, value in enumerate(values):
            page = start + i
            if value is None:
                break  # evicted between the two calls
            try:
                payload = decode_page(value, keys[i], ids[page * ps:(page + 1) * ps], self.page_nbytes)
            except BadPage as e:
                self.stats.corrupt_pages += 1
                logger.warning("KV store page %s refused (%s); recomputing from page %d", keys[i], e.reason, page)
                self._forget(keys[i])
                break
            out.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            nbytes += len(value)
        self.stats.on_read(len(keys), len(out), nbytes, time.perf_counter() - started)
        self._remember(digests[start:start + len(out)])
        return out

    def _forget(self, key: str) -> None:
        try:
            self.backend.remove(key)
        except Exception:  # noqa: BLE001 - best effort: a later writer replaces it anyway
            logger.debug("removing bad page %s failed", key, exc_info=True)

    def ready(self, now: float | None = None) -> list:
        """Requests whose read is over (done, or past its wait), in arrival order (engine thread)."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            for rid, p in list(self._pending.items()):
                done = p.future.done()
                if not (done or self.policy == "best_effort" or now >= p.deadline):
                    continue
                del self._pending[rid]
                if done and p.future.exception() is None:
                    p.payloads = p.future.result()
                    if p.payloads:
                        self._ready[rid] = p
                elif not done:
                    self.stats.prefetch_timeouts += 1
                out.append(p.req)
        return out

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, seconds: float) -> None:
        """Sleep until a read ends or `seconds` pass (engine thread, with nothing else to do)."""
        with self._wake:
            if self._pending and not any(p.future.done() for p in self._pending.values()):
                self._wake.wait(seconds)

    def take(self, request_id: str, cached_pages: int) -> list[torch.Tensor]:
        """The pages read for `request_id` that continue its first `cached_pages` (device hits); consumed."""
        p = self._ready.pop(request_id, None)
        if p is None or cached_pages < p.start or cached_pages >= p.start + len(p.payloads):
            return []
        shape = self.pool_kv.shape[1:]
        return [t.view(self.pool_kv.dtype).view(shape) for t in p.payloads[cached_pages - p.start:]]

    def discard(self, request_id: str) -> None:
        """Forget `request_id`'s read (it ended before admission)."""
        with self._lock:
            self._pending.pop(request_id, None)
        self._ready.pop(request_id, None)

    def copy_in(self, pages: Sequence[int], payloads: Sequence[torch.Tensor]) -> None:
        """Write pages read from the store into device `pages` of the pool (engine thread)."""
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.pool_kv.device)
        self.pool_kv[idx] = torch.stack(list(payloads)).to(self.pool_kv.device)
        self.stats.loaded_pages += len(pages)
        self.stats.loaded_bytes += len(pages) * self.page_nbytes

    # ---- health -------------------------------------------------------------------------------------------
    def _lost(self, err: Exception) -> None:
        with self._lock:
            if not self.available or self._closed.is_set():
                return
            self.available = False
            self.stats.disconnects += 1
        logger.warning("KV store unavailable (%s): serving without it; reconnecting every %.0f s", err,
                       RECONNECT_SECS)

    def _health_loop(self) -> None:
        """Every `RECONNECT_SECS`: while the store is in use, ping it (a worker that sends it nothing still learns
        that it went away, and says so in ``pd:kv_store_available``); while it is not, try to reach it again."""
        while not self._closed.wait(RECONNECT_SECS):
            if self.available:
                try:
                    self.backend.ping()
                except StoreUnavailable as e:
                    self._lost(e)
                except Exception:  # noqa: BLE001
                    logger.debug("KV store ping failed", exc_info=True)
                continue
            try:
                self.backend.reconnect()
            except StoreUnavailable as e:
                logger.debug("KV store still unavailable: %s", e)
                continue
            except Exception:  # noqa: BLE001
                logger.debug("KV store reconnect failed", exc_info=True)
                continue
            with self._lock:
                self._known.clear()  # a restarted store may have lost what it held
                self.available = True
            logger.info("KV store %s reachable again: reading and writing pages", self.backend.name)

    def close(self) -> None:
        self._closed.set()
        self._writes.put(None)
        self._writer.join(timeout=5)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
