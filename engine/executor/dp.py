"""`DPAttentionEngine`: one engine instance of ``--dp-size`` rank processes with data-parallel attention.

SGLang's ``--tp-size N --dp-size N --enable-dp-attention``. Each DP rank is an
OS process with its own `LLMEngine`: its own scheduler, page allocator, prefix
cache, KV pool and requests, its attention (and dense layers) whole, and its
MoE layers over the group of all ranks (`pd_cluster.engine.parallel.dp_attention`).
This driver, in the caller's process, holds no model: it tokenizes, assigns
each request to a rank and steps every rank once per `step` in lockstep; a rank
with no work runs an idle pass of its MoE layers (`DPMoEGroup.end_step`) so the
collectives of every rank pair up.

Rank assignment (SGLang's ``data_parallel_rank`` pins a request): otherwise the
rank with the fewest unfinished requests of this driver, the lowest rank on a
tie, so a fresh batch goes round robin.

Commands travel over one pipe per rank (pickled tuples); the ranks' step outputs
come back the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoTokenizer

from pd_cluster.common.net import free_port
from pd_cluster.engine.config import EngineConfig, ParallelConfig
from pd_cluster.engine.errors import RequestRejected
from pd_cluster.engine.executor.rank_procs import rank_process
from pd_cluster.engine.executor.tp import rank_device
from pd_cluster.engine.model.arch import ArchConfig, check_model_folder
from pd_cluster.engine.model.generation_config import load_generation_config
from pd_cluster.engine.model.moe_config import check_moe_parallel
from pd_cluster.engine.outputs import StepOutput
from pd_cluster.engine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a rank must load its weights and size its pool by then


ROLE_USES = {"mixed": "the offline engine (role mixed)", "decode": "decode workers (pd-worker --role decode, "
              "pd-serve's --decode-arg)"}


def check_dp_attention(config: EngineConfig, roles: tuple[str, ...] = ("mixed",)) -> ArchConfig:
    """Refuse, before any rank starts, a model or setting DP attention is not built for.

    Args:
        roles: the engine roles the caller runs DP attention for (`DPAttentionEngine`: mixed; a decode worker's
            instance, `pd_cluster.decode.dp_instance`: decode).

    Raises:
        ValueError: naming the flag (a dense model, experts that ``--tp-size`` cannot split, quantised weights,
            speculative decoding, a role not in `roles`).
    """
    p = config.parallel
    arch = ArchConfig.from_pretrained(config.model.path)
    if arch.moe is None:
        raise ValueError(f"--enable-dp-attention is built for mixture-of-experts models only ({arch.architecture} "
                         "has no MoE layers: serve it with --tp-size alone or one worker per replica)")
    check_moe_parallel(arch.moe, p.tp_size, p.enable_expert_parallel, p.ep_num_redundant_experts)
    if arch.quant is not None:
        raise ValueError(f"--enable-dp-attention is not built for quantised checkpoints yet ({arch.quant.method})")
    if config.speculative.enabled:
        raise ValueError("--speculative-algorithm is not built with --enable-dp-attention yet (a verify step "
                         "would run forwards the other DP ranks do not pair)")
    if config.role not in roles:
        raise ValueError(f"--enable-dp-attention is built for {' and '.join(ROLE_USES[r] for r in roles)}, not "
                         f"role {config.role} yet")
    return arch


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """DP rank `rank`'s own engine configuration: one attention rank on its own device, no CUDA graphs (a step's
    MoE collectives depend on every rank's batch)."""
    device = rank_device(config, rank)
    return dataclasses.replace(
        config, parallel=ParallelConfig(
            enable_expert_parallel=config.parallel.enable_expert_parallel,
            ep_num_redundant_experts=config.parallel.ep_num_redundant_experts, enable_eplb=config.parallel.enable_eplb,
            eplb_rebalance_num_iterations=config.parallel.eplb_rebalance_num_iterations),
        device=dataclasses.replace(config.device, device=str(device), disable_cuda_graph=True))


def _rank_main(rank: int, size: int, master: tuple[str, int], config: EngineConfig, conn, log_level: int) -> None:
    """A DP rank's process: build its engine, then run the driver's commands until ``stop``."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s dp{rank} %(name)s: %(message)s")
    import torch

    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.engine.parallel.dp_attention import init_dp_group

    own = rank_config(config, rank)
    device = rank_device(config, rank)
    if device.type == "cpu":
        torch.set_num_threads(config.device.cpu_threads)
    try:
        group = init_dp_group(rank, size, master, device)
        engine = LLMEngine(own, group=group)
    except BaseException as e:  # noqa: BLE001 - told to the driver, which fails its start
        conn.send(("error", e))
        return
    moe = group.moe
    hidden, dtype = engine.arch.hidden_size, engine.loaded.dtype
    moe_layers = _moe_layers(engine.loaded.model)
    conn.send(("ready", _describe(engine)))
    while True:
        name, args = conn.recv()
        if name == "stop":
            break
        try:
            if name == "step":
                try:
                    out = engine.step()
                finally:  # a step that failed before its forward still pairs the other ranks' collectives
                    idled = moe.end_step(moe_layers, hidden, dtype)
                result: Any = (out, engine.has_work(), engine.load(), idled)
            elif name == "add":
                result = engine.add_request(*args)
            elif name == "abort":
                result = engine.abort_request(*args)
            elif name == "load":
                result = engine.load()
            elif name == "expert_distribution":
                result = engine.expert_distribution()
            else:
                raise ValueError(f"unknown DP rank command {name!r}")
        except Exception as e:  # noqa: BLE001 - raised again by the driver
            result = e
        conn.send(result)
    engine.close()
    moe.destroy()


def _moe_layers(model) -> list:
    """The model's MoE blocks, in layer order."""
    from pd_cluster.engine.model.moe import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _describe(engine) -> dict:
    """What a DP rank holds: its pool's size, its first MoE layer's experts, its first layer's attention heads."""
    model = engine.loaded.model
    moe = _moe_layers(model)[0]
    experts = moe.experts
    return {"num_pages": engine.pool.num_pages, "max_total_num_tokens": engine.pool.max_total_num_tokens,
            "max_running_requests": engine.max_running_requests,
            "attention_heads": model.layers[0].self_attn.num_heads,
            "experts": (experts.first_expert, experts.num_local_experts, tuple(experts.w13_weight.shape)),
            "shared_width": None if moe.shared_experts is None else moe.shared_experts.intermediate_size}


def pick_dp_rank(unfinished: list[int], data_parallel_rank: int | None = None) -> int:
    """The DP rank of a new request: `data_parallel_rank` when given (SGLang's field), else the rank with the fewest
    `unfinished` requests, the lowest on a tie (a fresh batch goes round robin).

    Raises:
        RequestRejected: `data_parallel_rank` is not an int in ``[0, len(unfinished))``.
    """
    size = len(unfinished)
    if data_parallel_rank is not None:
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int) or \
                not 0 <= data_parallel_rank < size:
            raise RequestRejected(f"data_parallel_rank {data_parallel_rank!r} is not in [0, {size})",
                                  param="data_parallel_rank")
        return data_parallel_rank
    return min(range(size), key=lambda r: (unfinished[r], r))


class DPLockstep:
    """The lockstep of a DP rank whose engine runs in its own step loop (a worker's `EngineLoop`, not the driver
    above): every loop iteration asks the other ranks whether any has work (`any_work`: one all-reduce over the
    object group), and when one has, every rank steps once and closes its step with `end_step` (the idle pass of
    its MoE layers when its own step ran no forward). SGLang's DP ranks sync their batches the same way each
    iteration of their schedulers' loops (``prepare_mlp_sync_batch``).

    Call both from the engine's thread only, once per iteration on every rank.
    """

    def __init__(self, engine) -> None:
        self.group = engine.dp_group
        self.layers = _moe_layers(engine.loaded.model)
        self.hidden, self.dtype = engine.arch.hidden_size, engine.loaded.dtype
        self.idle_steps = 0  # steps this rank ran only the idle pass

    @classmethod
    def of(cls, engine) -> "DPLockstep | None":
        """The lockstep of `engine` when it is a DP attention rank, else None."""
        group = getattr(engine, "dp_group", None)
        return cls(engine) if getattr(group, "gathers_tokens", False) is True else None

    def any_work(self, mine: bool) -> bool:
        """Whether any DP rank has work (this one's answer is `mine`)."""
        return self.group.all_min(0 if mine else 1) == 0

    def end_step(self) -> None:
        self.idle_steps += self.group.end_step(self.layers, self.hidden, self.dtype)


@dataclass
class DPRequest:
    """The driver's view of a request on a DP rank (what `LLM.generate` reads): filled from its deltas."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    dp_rank: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)


class DPAttentionEngine:
    """The engine of ``--tp-size N --dp-size N --enable-dp-attention``: N DP rank processes (module docstring).

    The same calls as `LLMEngine` for offline generation: `add_request`, `step`, `has_work`, `abort_request`,
    `load`, `close`; ``requests`` maps each unfinished request id to its `DPRequest`.

    Raises:
        ValueError: a refused setting (`check_dp_attention`, `ParallelConfig`), or a rank's start-up error.
        RuntimeError: a rank process died or did not start in time.
    """

    def __init__(self, config: EngineConfig) -> None:
        check_model_folder(config.model.path)
        self.generation = load_generation_config(config.model.generation_config, config.model.path)
        self.arch = check_dp_attention(config)
        self.config = config
        self.dp_size = config.parallel.dp_size
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
        self.tokenizer.model_max_length = sys.maxsize
        self.requests: dict[str, DPRequest] = {}
        master = ("127.0.0.1", free_port())
        level = logging.getLogger().getEffectiveLevel()
        pipes = [mp.Pipe() for _ in range(self.dp_size)]
        self.procs = [rank_process(_rank_main, (r, self.dp_size, master, config, pipes[r][1], level), f"dp-rank-{r}")
                      for r in range(self.dp_size)]
        for p in self.procs:
            p.start()
        self._conns = [a for a, _ in pipes]
        self._busy = [False] * self.dp_size
        self._loads: list[dict] = [{} for _ in range(self.dp_size)]
        self.idle_steps = [0] * self.dp_size  # steps each rank ran only the idle pass of its MoE layers
        try:
            self.rank_info = [self._expect_ready(r) for r in range(self.dp_size)]
        except BaseException:
            self.close(graceful=False)
            raise
        logger.info("DP attention: %d ranks, expert parallel %s; KV pages per rank %s", self.dp_size,
                    config.parallel.enable_expert_parallel, [i["num_pages"] for i in self.rank_info])

    def _expect_ready(self, rank: int) -> dict:
        conn = self._conns[rank]
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"DP rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"DP rank {rank} exited during start-up (exit code {self.procs[rank].exitcode})")
        if kind == "error":
            raise value
        return value

    def _call(self, rank: int, name: str, *args: Any) -> Any:
        self._conns[rank].send((name, args))
        return self._result(rank)

    def _result(self, rank: int) -> Any:
        try:
            result = self._conns[rank].recv()
        except EOFError:
            raise RuntimeError(f"DP rank {rank} is gone (exit code {self.procs[rank].exitcode})") from None
        if isinstance(result, Exception):
            raise result
        return result

    # ---- requests --------------------------------------------------------------
    def pick_rank(self, data_parallel_rank: int | None = None) -> int:
        """The DP rank of a new request (`pick_dp_rank` over this driver's unfinished requests)."""
        counts = [0] * self.dp_size
        for req in self.requests.values():
            counts[req.dp_rank] += 1
        return pick_dp_rank(counts, data_parallel_rank)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    stream: bool = False, resumed_output_ids: list[int] | tuple[int, ...] = (),
                    data_parallel_rank: int | None = None) -> str:
        """Queue a request on its DP rank (`pick_rank`); returns its id. Raises as `LLMEngine.add_request`, and
        `RequestRejected` for a `data_parallel_rank` out of range."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", param="request_id")
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        rank = self.pick_rank(data_parallel_rank)
        self._call(rank, "add", request_id, ids, params, stream, list(resumed_output_ids))
        self.requests[request_id] = DPRequest(request_id, ids, params, rank, list(resumed_output_ids))
        self._busy[rank] = True
        return request_id

    def abort_request(self, request_id: str, release_pages: bool = True) -> bool:
        """Stop a request on its rank; its final delta comes with the next step."""
        req = self.requests.get(request_id)
        if req is None or not self._call(req.dp_rank, "abort", request_id, release_pages):
            return False
        self._busy[req.dp_rank] = True  # its final delta comes with the rank's next step
        return True

    # ---- the step ----------------------------------------------------------------
    def has_work(self) -> bool:
        return any(self._busy)

    def step(self) -> StepOutput:
        """One step of every DP rank, in lockstep (each runs its own batch, or an idle pass); their deltas."""
        for conn in self._conns:
            conn.send(("step", ()))
        out = StepOutput()
        for rank in range(self.dp_size):
            part, self._busy[rank], self._loads[rank], idled = self._result(rank)
            self.idle_steps[rank] += idled
            out.deltas += part.deltas
            out.num_tokens += part.num_tokens
        for d in out.deltas:
            req = self.requests.get(d.request_id)
            if req is None:
                continue
            req.output_token_ids += d.new_token_ids
            req.logprobs += d.new_logprobs or []
            if d.finished:
                del self.requests[d.request_id]
        return out

    # ---- introspection -------------------------------------------------------------
    def load(self) -> dict:
        """The instance's numbers (`LLMEngine.load`'s keys, summed over the ranks; ``token_usage`` of the fullest
        rank) and each rank's own under ``dp_ranks`` (as of the last step)."""
        ranks = [self._call(r, "load") for r in range(self.dp_size)]
        total = {k: sum(r[k] for r in ranks) for k in ("num_running_reqs", "num_queue_reqs", "num_free_pages",
                                                        "num_evictable_pages", "num_total_pages",
                                                        "max_running_requests")}
        return {"role": ranks[0]["role"], **total, "token_usage": max(r["token_usage"] for r in ranks),
                "dp_ranks": ranks}

    def expert_distribution(self) -> list[dict | None]:
        """Each DP rank's EPLB statistics (`LLMEngine.expert_distribution`: its own tokens' expert load)."""
        return [self._call(r, "expert_distribution") for r in range(self.dp_size)]

    def close(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop the DP ranks (a ``stop`` command, or with ``graceful=False`` SIGKILL). Unusable afterwards."""
        for rank, p in enumerate(self.procs):
            if graceful and p.is_alive():
                try:
                    self._conns[rank].send(("stop", ()))
                except OSError:
                    pass
            else:
                p.kill()
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(timeout)
        self.procs = []
