"""Random request lives over a hybrid pool's page manager and per-group prefix cache, in both roles that own
pages: a PD decode (match, `reserve_remote`, the KV "arrives", decode steps) and a mixed worker (match, grow,
compute). Requests share prefixes, are refused after a match, end at any point, and the cache is evicted at random
moments, with a sliding-window and a chunked group beside a full one (4-token pages, window and chunk of 8).

After every history: no exception, every cached page is reachable from its tree's root (a page below a node that
left the tree could never be hit again), and once every request ended and the cache is emptied, every page is
free (none is counted evictable but never evicted, none is held by nobody).
"""

from __future__ import annotations

import random

import pytest

from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.group_cache import GroupedPrefixCache
from pd_cluster.engine.kv.groups import KVGroup, KVGroups
from pd_cluster.engine.request import Request
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.scheduler.group_pages import GroupedPageManager

PS, POOL = 4, 200


def _reachable(tree) -> set[int]:
    out, todo = set(), [tree.root]
    while todo:
        node = todo.pop()
        for child in node.children.values():
            assert child.parent is node
            out.add(id(child))
            todo.append(child)
    return out


def _history(seed: int, kind: str, role: str) -> None:
    rnd = random.Random(seed)
    groups = KVGroups((KVGroup(("full", 0), (0,)), KVGroup((kind, 8), (1,))), 2)
    alloc = PageAllocator(POOL)
    cache = GroupedPrefixCache(alloc, PS, groups)
    pages = GroupedPageManager(alloc, PS, groups, 16, cache)
    params = SamplingParams(max_tokens=40)
    bases = [[rnd.randrange(5) for _ in range(rnd.randint(4, 40))] for _ in range(4)]
    live: dict[str, list] = {}
    for step in range(300):
        op = rnd.random()
        if op < 0.3 and len(live) < 6:
            ids = list(rnd.choice(bases)) + [rnd.randrange(5) for _ in range(rnd.randint(0, 12))]
            if len(ids) < 2:
                continue
            req = Request(f"r{step}", ids, params, remote_kv=role == "decode")
            req.num_computed_tokens = pages.match(req)
            if role == "decode":
                if not pages.can_reserve_remote(req) or rnd.random() < 0.2:
                    pages.release(req)  # not admitted: the matched pages go back
                    continue
                pages.reserve_remote(req)
            else:
                pages.trim(req)
                if not pages.can_grow(req, req.num_tokens) or rnd.random() < 0.2:
                    pages.release(req)
                    continue
                pages.grow(req, req.num_tokens)
            live[req.request_id] = [req, "waiting"]
        elif op < 0.45 and live:
            req, state = live[rnd.choice(list(live))]
            if state == "waiting":  # the prompt's KV is computed (mixed) or arrived (decode)
                req.num_computed_tokens = req.num_tokens
                pages.cache_computed(req)
                live[req.request_id][1] = "running"
        elif op < 0.8 and live:
            req, state = live[rnd.choice(list(live))]
            if state == "running":  # one decode step
                req.token_ids.append(rnd.randrange(5))
                pages.trim(req)
                if pages.can_grow(req, req.num_tokens):
                    pages.grow(req, req.num_tokens)
                    req.num_computed_tokens = req.num_tokens
                    pages.cache_computed(req)
        elif op < 0.9 and live:
            pages.release(live.pop(rnd.choice(list(live)))[0])
        else:
            cache.evict(rnd.randint(1, 10))
    for req, _ in live.values():
        pages.release(req)
    for g, tree in enumerate(cache.trees):
        reach = _reachable(tree)
        lost = [p for p, node in tree._by_page.items() if id(node) not in reach]
        assert not lost, f"group {g}: cached pages {lost} hang below a node out of the tree"
    cache.evict(10 ** 6)
    assert alloc.num_free == POOL, f"{POOL - alloc.num_free} pages neither free nor evictable"


@pytest.mark.parametrize("role", ["decode", "mixed"])
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_random_request_lives_leave_every_page_free_and_every_cached_page_reachable(kind, role):
    for seed in range(150):
        try:
            _history(seed, kind, role)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
