"""A prompt holding a lone UTF-16 surrogate (``"\\ud800"``, valid JSON, not valid Unicode) gets its 400 from the
worker; the router routes it without a traceback: its routing text hashes, and its tokenizer (``--tokenizer-path``)
gives such a prompt no token ids instead of failing the batch it was in."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from router_testkit import StubCandidate

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.router.config import CacheAwareConfig, KvRoutingConfig
from pd_cluster.router.kv_index import KvIndex
from pd_cluster.router.policies import CacheAware, RouteRequest
from pd_cluster.router.request import parse_request
from pd_cluster.router.text_map import TextMap
from pd_cluster.router.tokenizer import RouterTokenizer

BAD = [({"prompt": "Once upon a \ud800 time"}, False),
       ({"messages": [{"role": "user", "content": "Hello \udfff there"}]}, True),
       ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud83d"}]}]}, True)]
GOOD = [({"prompt": "Once upon a time"}, False), ({"messages": [{"role": "user", "content": "Hello there"}]}, True)]


def test_the_tokenizer_gives_bad_text_no_ids_and_logs_no_error(caplog):
    tok = RouterTokenizer(DEFAULT_MODEL, max_chars=10000, threads=1)
    tok._load_and_start()

    async def run():
        return await asyncio.gather(*(tok.prompt(body, chat, (16,)) for body, chat in BAD + GOOD))

    with caplog.at_level(logging.DEBUG, logger="pd_cluster.router.tokenizer"):
        got = asyncio.run(run())
    tok.close()
    assert got[:len(BAD)] == [None] * len(BAD)
    assert all(p is not None and p.token_ids for p in got[len(BAD):])  # the same batch: still tokenized
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_the_text_path_routes_bad_text(caplog):
    text_map = TextMap()
    policy = CacheAware(CacheAwareConfig(), time.monotonic, KvIndex(text_polled=text_map.polled_since),
                        KvRoutingConfig(), text_map)
    with caplog.at_level(logging.DEBUG):
        for body, chat in BAD:
            request = RouteRequest(parse_request(json.dumps(body).encode(), chat).text)
            assert policy.select([StubCandidate("a"), StubCandidate("b")], request).url in ("a", "b")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
