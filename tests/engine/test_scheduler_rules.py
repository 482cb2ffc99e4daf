"""The scheduler's admission, budget, retraction, hold and prefix-cache rules, without a model.

Each test drives the real `Scheduler` over a real `PageManager` (and `PrefixCache`);
"running the model" is appending a token to every request whose step reached
its last known token.
"""

from __future__ import annotations

from pd_cluster.engine.config import SchedulerConfig
from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.prefix_cache import PrefixCache
from pd_cluster.engine.request import Request, RequestStatus
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.scheduler.page_manager import PageManager
from pd_cluster.engine.scheduler.output import SchedulerOutput
from pd_cluster.engine.scheduler.scheduler import Scheduler

PAGE = 4


def make(num_pages: int = 16, role: str = "mixed", cache: bool = True, max_running: int = 8,
         **config) -> Scheduler:
    alloc = PageAllocator(num_pages)
    pages = PageManager(alloc, PAGE, PrefixCache(alloc, PAGE) if cache else None)
    return Scheduler(SchedulerConfig(**config), pages, role, max_running)


def request(rid: str, prompt: int | list[int], max_tokens: int = 4, remote: bool = False, **params) -> Request:
    """A request; an int prompt gets tokens of its own (no prefix shared with other ids)."""
    base = 1000 * sum(map(ord, rid))
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), remote_kv=remote)


def step(s: Scheduler) -> SchedulerOutput:
    """One step: schedule, 'run', sample token 7 where due, finish what is done."""
    out = s.schedule()
    s.on_step_done(out)
    for item in out.scheduled:
        if item.samples:
            item.req.append_token(7)
            status = item.req.check_stop()
            if status is not None:
                s.finish(item.req, status)
    return out


def shares(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    return {it.req.request_id: (it.start, it.num_new_tokens) for it in out.scheduled}


def in_use(s: Scheduler) -> int:
    return s.pages.num_in_use


# ---- token budget -----------------------------------------------------------------------------
def test_running_first_then_waiting_in_fcfs_order_within_the_budget():
    s = make(chunked_prefill_size=5, max_prefill_tokens=8, cache=False)
    for rid in "abc":
        s.add(request(rid, 12))
    assert shares(step(s)) == {"a": (0, 5), "b": (0, 3)}  # c waits: no budget left
    assert shares(step(s)) == {"a": (5, 5), "b": (3, 3)}  # running first, in admission order
    assert shares(step(s)) == {"a": (10, 2), "b": (6, 5), "c": (0, 1)}
    out = step(s)
    assert [d.req.request_id for d in out.decodes] == ["a"] and shares(out)["a"] == (12, 1)  # a decodes


def test_max_running_requests_caps_admission():
    s = make(max_running=2)
    for rid in "abc":
        s.add(request(rid, 3))
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b"] and [r.request_id for r in s.waiting] == ["c"]


# ---- admission --------------------------------------------------------------------------------
def test_a_new_request_waits_while_running_ones_keep_their_reservation():
    s = make(num_pages=16, cache=False)  # 64 tokens
    s.add(request("a", 8, max_tokens=40))
    step(s)
    # a holds 8 tokens and reserves 0.7 x its remaining 39 outputs (27.3); b needs 8 + 40 > 64 - 12 - 27.3
    s.add(request("b", 8, max_tokens=40))
    s.add(request("c", 2, max_tokens=2))  # would fit, but FCFS: nobody overtakes the head
    step(s)
    assert [r.request_id for r in s.running] == ["a"] and [r.request_id for r in s.waiting] == ["b", "c"]
    while s.running:
        step(s)
    out = step(s)
    assert set(shares(out)) == {"b", "c"}


def test_a_request_alone_is_admitted_even_when_its_output_budget_exceeds_the_pool():
    s = make(num_pages=4, cache=False)  # 16 tokens; 8 + 100 can not all fit
    s.add(request("a", 8, max_tokens=100))
    assert shares(step(s)) == {"a": (0, 8)}


# ---- retraction ---------------------------------------------------------------------------------
def test_the_newest_running_request_is_retracted_and_requeued_first():
    # 20 tokens. a (4 + 16 tokens, 5 pages) runs alone; b (4 + 6, 3 pages) is admitted because little of
    # a's output is reserved (conservativeness 0.05); together they outgrow the pool.
    s = make(num_pages=5, cache=False, schedule_conservativeness=0.05)
    s.add(request("a", 4, max_tokens=16))
    step(s)
    s.add(request("b", 4, max_tokens=6))
    step(s)
    assert [r.request_id for r in s.running] == ["a", "b"]
    ratio = s.admission.new_token_ratio
    retracted = []
    for _ in range(20):
        retracted += step(s).retracted
        if retracted:
            break
    b = retracted[0]
    assert b.request_id == "b" and s.waiting[0] is b  # the most recently admitted, back at the front
    assert b.status == RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_retractions == 1 and s.num_retracted_total == 1 and b.num_output_tokens > 0
    assert s.admission.new_token_ratio > ratio
    outs = [step(s) for _ in range(40)]
    assert shares(outs[-1]) == {} and [o.retracted for o in outs if o.retracted] == []
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 6
    assert in_use(s) == 0 and s.pages.num_available == 5


def test_the_prefill_role_holds_finished_pages_and_waits_for_them_without_retracting():
    s = make(num_pages=3, role="prefill", cache=False, chunked_prefill_size=4)
    s.add(request("a", 8, max_tokens=1))  # the prefill role's requests end after their first token
    s.add(request("b", 8, max_tokens=1))
    outs = [step(s), step(s)]
    assert [shares(o) for o in outs] == [{"a": (0, 4)}, {"a": (4, 4)}]  # b waits: a reserves 9 tokens
    assert s.held["a"].status == RequestStatus.PREFILLED and len(s.held["a"].block_table) == 2
    outs = [step(s), step(s), step(s)]
    assert [shares(o) for o in outs] == [{"b": (0, 4)}, {}, {}]  # b can not grow while a's pages are held
    assert not any(o.retracted for o in outs) and [r.request_id for r in s.running] == ["b"]
    assert s.release("a") is not None and s.held == {}
    assert shares(step(s)) == {"b": (4, 4)}


def test_cached_pages_are_evicted_before_any_request_is_retracted():
    s = make(num_pages=6)
    old = list(range(12))
    s.add(request("old", old, max_tokens=1))
    step(s)  # 3 full pages cached; finished at once
    assert s.pages.num_evictable == 3 and in_use(s) == 0
    s.add(request("a", 4, max_tokens=16))  # grows to 5 pages: 3 free + 2 evicted, the tail of `old` first
    outs = [step(s) for _ in range(17)]
    assert not any(o.retracted for o in outs) and s.num_retracted_total == 0
    assert s.pages.cache.num_evicted_total == 2 and not s.has_work()
    s.add(request("again", old[:6], max_tokens=1))
    assert step(s).num_cached_tokens == 4  # the head page of `old` survived (leaves go first)


# ---- holding pages ------------------------------------------------------------------------------
def test_held_pages_have_one_writer():
    s = make(cache=False)
    s.add(request("a", 6))
    s.add(request("w", 6))
    step(s)
    a, w = s.running
    s.add(queued := request("q", 6))
    assert s.remove(a, release_pages=False) is True and s.held == {"a": a}  # pages may still be read
    assert s.remove(queued, release_pages=False) is False and "q" not in s.held  # no pages: nothing to hold
    assert s.release("nope") is None
    assert s.release("a") is a and a.block_table == [] and s.held == {}
    assert s.remove(w) is False and in_use(s) == 0


def test_the_decode_role_reserves_the_whole_prompt_for_remote_kv():
    s = make(role="decode", cache=False)
    r = request("r", 9, remote=True)
    s.add(r)
    out = step(s)
    assert out.reserved == [r] and out.is_empty and len(r.block_table) == 3
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and s.num_holding == 1
    s.complete_remote(r)
    r.append_token(7)
    assert r.num_computed_tokens == 9 and shares(step(s)) == {"r": (9, 1)}


# ---- prefix cache -------------------------------------------------------------------------------
def test_a_request_starts_at_its_cached_length_and_recomputes_its_last_token():
    s = make()
    prompt = list(range(10))
    s.add(request("a", prompt))
    out = step(s)
    assert out.num_cached_tokens == 0 and out.prefix_cache_queries == 10 and out.prefix_cache_hits == 0
    s.add(request("b", prompt))  # same prompt: 2 full pages cached, the 3rd page is partial
    out = step(s)
    assert shares(out)["b"] == (8, 2) and out.num_cached_tokens == 8 and out.prefix_cache_hits == 8
    s.add(request("c", prompt[:8]))  # its 8 tokens are 2 cached pages; the last one must still run
    out = step(s)
    assert shares(out)["c"] == (4, 4) and s.running[-1].num_cached_tokens == 4
    s.add(request("d", prompt, prompt_logprobs=1))  # needs every prompt position's logits: no lookup
    out = step(s)
    assert shares(out)["d"] == (0, 10) and out.prefix_cache_queries == 0


def test_a_request_that_can_not_be_admitted_gives_its_matched_pages_back():
    s = make(num_pages=5)
    prompt = list(range(12))
    s.add(request("a", prompt, max_tokens=1))
    step(s)  # 3 cached pages, evictable
    s.add(request("big", 9, max_tokens=4))  # takes 3 pages: 2 free, 1 evicted (a's last, a leaf)
    step(s)
    assert s.pages.num_evictable == 2 and s.pages.cache.num_evicted_total == 1
    s.add(request("b", prompt + list(range(50, 58)), max_tokens=1))  # 2 cached pages + 3 it can not get
    before = (s.pages.num_evictable, in_use(s))
    assert before == (2, 3)
    out = step(s)
    assert "b" not in shares(out) and s.waiting[0].request_id == "b"
    assert s.waiting[0].block_table == [] and s.waiting[0].num_computed_tokens == 0
    assert (s.pages.num_evictable, in_use(s)) == before
