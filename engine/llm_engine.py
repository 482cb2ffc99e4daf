"""`LLMEngine`: one model, one KV pool, one scheduler; `step()` advances every request by one step.

The step loop is nano-vllm's four lines: schedule, run the model, update the
requests, collect outputs, with at most one step in flight (overlap
scheduling, `pd_cluster.engine.overlap`). The split is vLLM v1's: the engine
owns the scheduler, the runner, grammar acceptance, the stop checks on token
ids and page release; its `OutputProcessor` owns each request's text, stop
strings and deltas. The engine is single-threaded; servers drive `step()`
from one thread and feed requests in between steps. Its request methods
(add, abort, fail, release, each token's checks) are in `engine_requests.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

import torch
from transformers import AutoTokenizer

from pd_cluster.engine.config import EngineConfig, format_size
from pd_cluster.engine.engine_requests import RequestLifecycle
from pd_cluster.engine.graph import CudaGraphConfig
from pd_cluster.engine.model.arch import check_model_folder
from pd_cluster.engine.model.generation_config import load_generation_config
from pd_cluster.engine.model.rope import longrope_threshold
from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.events import KVEventLog
from pd_cluster.engine.kv.group_cache import GroupedPrefixCache
from pd_cluster.engine.kv.hiradix_cache import build_prefix_cache
from pd_cluster.engine.kv.l3.setup import attach_l3
from pd_cluster.engine.model_runner import LaunchedStep, ModelRunner
from pd_cluster.engine.output_processor import OutputProcessor
from pd_cluster.engine.overlap import OverlapState, needs_host_tokens, overlap_mode
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.executor.tp import RankServer, TPDriver
from pd_cluster.engine.executor.context_parallel_checks import check_context_parallel
from pd_cluster.engine.executor.shard import build_shard, check_tp_size
from pd_cluster.engine.outputs import PrefillProgress, StepOutput
from pd_cluster.engine.request import Request, RequestStatus
from pd_cluster.engine.request_builder import RequestLimits
from pd_cluster.engine.sampling.grammar import GrammarManager
from pd_cluster.engine.scheduler.group_pages import GroupedPageManager
from pd_cluster.engine.scheduler.page_manager import PageManager
from pd_cluster.engine.scheduler.output import SchedulerOutput
from pd_cluster.engine.scheduler.scheduler import Scheduler
from pd_cluster.engine.spec.drafter import build_drafter, captures_decode_graphs
from pd_cluster.engine.spec.stats import SpecDecodeStats
from pd_cluster.engine.stats import EngineStats

logger = logging.getLogger("engine")

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine(RequestLifecycle):
    """The engine of one worker (any role); its request methods are `RequestLifecycle`'s (`engine_requests.py`).

    Args:
        config: the engine configuration.
        group: a DP attention rank's group (its attention on one rank, its MoE layers over the DP ranks:
            `pd_cluster.engine.parallel.dp_attention`); None otherwise.

    Raises:
        ValueError: invalid configuration, unsupported model, or a KV budget that holds no page.
    """

    def __init__(self, config: EngineConfig, group: TPGroup | None = None) -> None:
        if config.parallel.enable_dp_attention:
            raise ValueError("--enable-dp-attention: one engine per DP rank, run by `DPAttentionEngine` "
                             "(pd_cluster.engine.executor.dp) or a decode worker's DP instance "
                             "(pd_cluster.decode.dp_instance)")
        check_model_folder(config.model.path)  # before the tokenizer: a Hub id must not reach transformers
        # EOS ids and default sampling parameters (--generation-config), refused keys before any weight loads
        self.generation = load_generation_config(config.model.generation_config, config.model.path)
        self.config = config
        self.role = config.role
        self.tp_driver = None
        self._group = group or SINGLE  # a DP attention rank's group (`dp_attention.init_dp_group`)
        check_context_parallel(config)
        if config.parallel.eplb.active and config.parallel.tp_size == 1 and group is None:
            raise ValueError(f"{config.parallel.eplb.flags} need expert parallelism over several ranks "
                             "(--enable-expert-parallel with --tp-size > 1)")
        if config.parallel.tp_size > 1:
            check_tp_size(config.model.path, config.parallel.tp_size, config.parallel.enable_expert_parallel,
                          config.parallel.ep_num_redundant_experts)
        if config.parallel.world_size > 1:
            self.tp_driver = TPDriver(config)
        try:
            self._build(config)
        except BaseException:
            if self.tp_driver is not None:  # the ranks may sit in a collective: kill rather than command them
                self.tp_driver.shutdown(graceful=False)
                self.tp_driver = None
            raise

    def _build(self, config: EngineConfig) -> None:
        self.device = self.tp_driver.device if self.tp_driver else resolve_device(config.device.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.device.cpu_threads)
        mc = config.model
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer_path)
        self.tokenizer.model_max_length = sys.maxsize  # lengths are checked against --context-length instead
        tp = self.tp_driver.tp if self.tp_driver else self._group
        shard = build_shard(config, self.device, tp)
        self.shard = shard
        self.loaded, self.layout, self.pool_plan = shard.loaded, shard.layout, shard.plan
        self.pool, self.backend = shard.pool, shard.backend
        arch = self.loaded.arch
        self.arch = arch
        self.model_name = mc.name
        self.eos_token_ids = self._eos_ids()
        self.context_length = config.scheduler.context_length or arch.max_position_embeddings
        if self.context_length > arch.max_position_embeddings:
            logger.warning("context_length=%d exceeds the model's max_position_embeddings=%d; outputs past it "
                           "may degrade", self.context_length, arch.max_position_embeddings)
        self.allocator = PageAllocator(self.pool_plan.num_pages)
        self.kv_events = KVEventLog(self.layout.page_size)  # what the cache stores and evicts (GET /kv_events)
        self.kv_groups = self.pool.groups
        grouped = not self.kv_groups.is_single  # hybrid KV: one table per group, window pages freed
        sc = config.scheduler
        if grouped:  # one radix tree per group (no host tier: kv_groups keeps one group with it; none with states)
            self.prefix_cache = (GroupedPrefixCache(self.allocator, self.layout.page_size, self.kv_groups,
                                                    self.kv_events)
                                 if config.cache.enable_prefix_caching and self.kv_groups.state_group is None else None)
        else:
            self.prefix_cache = build_prefix_cache(config.cache, self.role, self.allocator, self.pool,
                                                   self.kv_events)
        self.host_tier = self.prefix_cache.host if self.prefix_cache is not None else None  # HiCache L2
        if grouped and config.speculative.enabled:
            raise ValueError(f"--speculative-algorithm {config.speculative.speculative_algorithm} is not built for "
                             f"models with several KV cache groups yet ({self.kv_groups.describe()}); "
                             f"start with --disable-hybrid-kv-cache-manager or without speculation")
        if grouped:
            self.pages = GroupedPageManager(self.allocator, self.layout.page_size, self.kv_groups,
                                            sc.chunked_prefill_size, self.prefix_cache)
            logger.info("hybrid KV cache: %s", self.kv_groups.describe())
        else:
            self.pages = PageManager(self.allocator, self.layout.page_size, self.prefix_cache)
        self.l3 = attach_l3(self)  # the cluster-wide KV store (HiCache L3), or None
        self.max_running_requests = sc.max_running_requests or min(256, self.pool_plan.num_pages)
        # the graphs' block-table width comes from the pool (graph_table_pages), never --context-length
        graphs = CudaGraphConfig(max_bs=min(config.device.cuda_graph_max_bs, self.max_running_requests),
                                 disable=config.device.disable_cuda_graph or not captures_decode_graphs(config))
        if self.tp_driver is not None:
            self.tp_driver.attach(RankServer(shard, tp, self.device))
            buckets = self.tp_driver.capture_decode_graphs(graphs)  # every rank, same buckets
            par = config.parallel
            logger.info("%d rank processes (TP %d x prefill CP %d); CUDA graph batch sizes on every rank: %s",
                        par.world_size, par.tp_size, par.prefill_context_parallel_size, buckets)
        else:  # None off CUDA or with --disable-cuda-graph
            shard.capture_decode_graphs(graphs)
        self.runner = ModelRunner(shard, self.device, mc.seed, self.tp_driver)
        spec = config.speculative
        self.drafter = build_drafter(config, self.context_length, arch.vocab_size, self.tokenizer, self.device,
                                     self.pool.num_pages, self.max_running_requests, self.runner)
        self.scheduler = Scheduler(sc, self.pages, self.role, self.max_running_requests, on_leave=self._left,
                                   drafter=self.drafter)
        self.grammars = GrammarManager(self.tokenizer, arch.vocab_size, self.eos_token_ids)
        backend_name = shard.backend_name
        self.stats = EngineStats(sc.decode_log_interval,
                                 SpecDecodeStats(spec.num_draft_tokens) if spec.enabled else None)
        self.scheduler.long_rope_from = longrope_threshold(arch.layer_attention)
        self.limits = RequestLimits(arch.vocab_size, self.context_length, self.layout.page_size,
                                    self.pool.num_pages, sc.max_queued_requests, self.eos_token_ids, self.role,
                                    None if not grouped else self.kv_groups, sc.chunked_prefill_size,
                                    self.scheduler.long_rope_from)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.role)
        self.overlap = OverlapState(*overlap_mode(config, self.device.type))
        self._log_startup(backend_name)

    # ---- start-up ------------------------------------------------------------
    def _eos_ids(self) -> tuple[int, ...]:
        """config.json's, the tokenizer's and the generation config's EOS ids (vLLM's stop set)."""
        ids = set(self.arch.eos_token_ids) | set(self.generation.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def _log_startup(self, backend_name: str) -> None:
        logger.info(
            "max_total_num_tokens=%d, page_size=%d, kv_cache_dtype=%s, context_len=%d, chunked_prefill_size=%d, "
            "max_running_requests=%d, available_mem=%s, kv_cache_memory=%s (%s), attention_backend=%s, role=%s, "
            "prefix_cache=%s, overlap_schedule=%s, speculative=%s",
            self.pool.max_total_num_tokens, self.layout.page_size, self.layout.kv_cache_dtype, self.context_length,
            self.config.scheduler.chunked_prefill_size, self.max_running_requests,
            format_size(self.pool_plan.available_bytes), format_size(self.pool.nbytes), self.pool_plan.source,
            backend_name, self.role, "off" if self.prefix_cache is None else "hierarchical" if self.host_tier else "on",
            self.overlap.describe(), self.config.speculative.describe())
        self.generation.log(self.eos_token_ids)

    def _left(self, req: Request) -> None:
        """`req` left the running set: its block-table row, and its draft KV (STANDALONE), are freed."""
        self.runner.release(req.request_id)
        if self.drafter is not None:
            self.drafter.release(req.request_id)

    @property
    def dp_group(self):
        """A DP attention rank's MoE group (`DPMoEGroup`: its step loop steps in lockstep with the other ranks',
        `pd_cluster.engine.executor.dp.DPLockstep`); None for any other engine."""
        moe = self._group.moe
        return moe if moe.gathers_tokens else None

    # ---- the step ----------------------------------------------------------------
    def has_work(self) -> bool:
        return (self.scheduler.has_work() or self.outputs.has_deltas or self.overlap.in_flight is not None
                or (self.l3 is not None and self.l3.has_pending()))

    def step(self) -> StepOutput:
        """Schedule and launch one step; complete the step before it; return what was completed.

        Without overlap scheduling the step launched is the one completed. With it (`pd_cluster.engine.overlap`)
        the step launched stays in flight until the next call, which completes it after launching its own
        (first, when a request of it needs its token on the host); `StepOutput.reserved` and
        ``local_prefills`` always report this call's scheduling.
        """
        started = time.monotonic()
        if self.l3 is not None:
            self._admit_prefetched()
        out = StepOutput()
        prev = self._take_in_flight(out)
        sched = self.scheduler.schedule()
        out.num_tokens = sched.num_tokens
        self._report_schedule(sched, out)
        launched = LaunchedStep.empty(sched, started) if sched.is_empty else self.runner.launch(sched, prev, started)
        self.scheduler.on_step_launched(sched)
        if self.overlap.enabled and not sched.is_empty:
            self._hold(launched, overlapped=prev is not None)
        else:
            self._complete_step(launched, out)
        if prev is not None:
            self._complete_in_flight(prev, out)
        out.deltas = self.outputs.take_deltas()
        return out

    def _take_in_flight(self, out: StepOutput) -> LaunchedStep | None:
        """The step in flight, to be completed after the next launch; completed now (and None returned) when
        a request of it needs its token on the host for its next sampling."""
        prev, self.overlap.in_flight = self.overlap.in_flight, None
        if prev is not None and any(r.status == RequestStatus.RUNNING and needs_host_tokens(r)
                                    for r in prev.sampled_reqs):
            self._complete_in_flight(prev, out)
            self.overlap.num_drains += 1
            return None
        return prev

    def _hold(self, launched: LaunchedStep, overlapped: bool) -> None:
        """Keep `launched` in flight; each request it samples counts the token it owes (`Request.num_inflight`)."""
        self.overlap.num_overlapped += overlapped
        for req in launched.sampled_reqs:
            req.num_inflight += 1
        self.overlap.in_flight = launched

    def _complete_in_flight(self, step: LaunchedStep, out: StepOutput) -> None:
        for req in step.sampled_reqs:
            req.num_inflight -= 1  # its token is about to be known (or dropped)
        self._complete_step(step, out)

    def _report_schedule(self, sched: SchedulerOutput, out: StepOutput) -> None:
        """What the scheduling itself decided (decode role: pages reserved, requests prefilled here)."""
        page = self.layout.page_size
        out.reserved = [(r.request_id, list(r.block_table), r.num_computed_tokens // page,
                         [list(t) for t in self.pages.tables(r)[1:]]) for r in sched.reserved]
        out.local_prefills = [r.request_id for r in sched.local_prefills]

    def _complete_step(self, step: LaunchedStep, out: StepOutput) -> None:
        """Wait for `step`'s tokens and apply them: progress, the cache, stops, deltas (`OutputProcessor`).

        A request that ended while the step was in flight (overlap scheduling) gets no token: it was aborted,
        or its previous token stopped it.
        """
        result = step.result()
        sched = step.sched
        self.scheduler.on_step_done(sched)
        now = time.monotonic()
        for item in sched.scheduled:
            req = item.req
            req.times.first_scheduled = req.times.first_scheduled or step.started
            if item.end >= req.num_prompt_tokens and req.times.prefill_done is None:
                req.times.prefill_done = now
            if self.role == "prefill":
                out.prefill_progress.append(PrefillProgress(
                    req.request_id, item.start, item.end, list(req.block_table), item.samples,
                    [list(t) for t in self.pages.tables(req)[1:]]))
        num_sampled = 0
        if result.sampler_output is not None:
            so = result.sampler_output
            failed = set()
            for req, tok, lp, err in zip(result.sampled_reqs, so.token_ids, so.logprobs, so.errors):
                if req.status.finished or req.status == RequestStatus.PREFILLED:
                    continue  # ended while this step was in flight
                num_sampled += 1
                if err is None:
                    self._on_token(req, tok, lp)
                    if req.status == RequestStatus.FINISHED_ERROR:  # its grammar refused the token
                        failed.add(req.request_id)
                elif self.fail_request(req.request_id, err):
                    failed.add(req.request_id)
            if failed:  # no first token to hand over: the prefill hooks see only the error delta
                out.prefill_progress = [p for p in out.prefill_progress if p.request_id not in failed]
        num_sampled += self._apply_verified(result.verified)
        self.stats.on_step(sched, self.scheduler, num_sampled)

    def _apply_verified(self, verified) -> int:
        """Speculative decoding: each verify's accepted drafts and correction or bonus token, in order, with the
        stop checks of every token (the ones after a stop are dropped); the rejected drafts' KV is rolled back
        first (`Scheduler.on_verified`). Returns the tokens applied."""
        applied = 0
        for item, v in verified:
            req = item.req
            if req.status != RequestStatus.RUNNING:
                continue  # ended while the step ran
            if v.error is not None:
                self.fail_request(req.request_id, v.error)
                continue
            self.scheduler.on_verified(item, v.num_accepted)
            self.stats.spec.on_verified(v)
            for tok, lp in zip(v.token_ids, v.logprobs):
                self._on_token(req, tok, lp)
                applied += 1
                if req.status != RequestStatus.RUNNING:
                    break
            if req.status == RequestStatus.RUNNING:
                self.pages.cache_computed(req)  # the accepted drafts' full pages
        return applied

    def close(self) -> None:
        """Stop the tensor-parallel ranks (no-op without TP) and the KV store's threads. The engine is unusable
        afterwards."""
        if self.l3 is not None:
            self.l3.close()
            self.l3 = None
        if self.tp_driver is not None:
            self.tp_driver.shutdown()
            self.tp_driver = None

    def set_role(self, role: str) -> None:
        """Turn an idle engine to the ``prefill`` or ``decode`` role in place, weights and KV pool kept (elastic
        PD's role switch, SGLang PR #28403; the worker re-builds its role's server and transfer parts around it).

        Raises:
            ValueError: `role` is not ``prefill`` or ``decode``.
            RuntimeError: a request is still in the engine, a page is still held, or a step is in flight.
        """
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if self.requests or self.scheduler.has_work() or self.overlap.in_flight is not None \
                or self.pages.num_available != self.allocator.num_pages:
            raise RuntimeError("the engine switches role only when idle with every page free")
        self.config = dataclasses.replace(self.config, role=role)
        self.role = self.scheduler.role = self.outputs.role = role
        self.scheduler.drafter = self.drafter if role != "prefill" else None
        self.limits = dataclasses.replace(self.limits, role=role)
        self.overlap = OverlapState(*overlap_mode(self.config, self.device.type))
        logger.info("engine role is now %s (overlap_schedule=%s)", role, self.overlap.describe())

    # ---- introspection -------------------------------------------------------------
    def num_free_pages(self) -> int:
        """Pages a request could take now: free ones plus unreferenced cached ones (evicted on demand)."""
        return self.pages.num_available

    def load(self) -> dict:
        """Numbers for ``/get_load`` and the gauges."""
        return {
            "role": self.role,
            "num_running_reqs": len(self.scheduler.running),
            "num_queue_reqs": len(self.scheduler.waiting),
            "token_usage": self.pages.token_usage,
            "num_free_pages": self.pages.num_available,
            "num_evictable_pages": self.pages.num_evictable,
            "num_total_pages": self.allocator.num_pages,
            "max_running_requests": self.max_running_requests,
            **(self.drafter.load() if self.drafter is not None else {}),  # STANDALONE: the draft pool's pages
        }


    def expert_distribution(self) -> dict | None:
        """EPLB's expert load (pairs routed to each logical expert since start, per MoE layer; this rank's tokens
        under DP attention, every token under TP) and placement (`ExpertBalancer.stats`); None without EPLB."""
        return None if self.shard.eplb is None else self.shard.eplb.stats()
