"""What a decode step sends between the ranks of one instance: DP attention's MoE exchanges against TP's all-reduces.

    python -m pd_cluster.bench.scripts.ep_comm                    # DeepSeek-V3's shapes, 2 ranks, gloo on CPU
    python -m pd_cluster.bench.scripts.ep_comm --ranks 4 --tokens-per-rank 1 32 128
    python -m pd_cluster.bench.scripts.ep_comm --smoke            # tiny shapes: checks the script anywhere

At the same batch (``T`` decode tokens on each of ``N`` ranks, ``N T`` in all), one decoder layer of each layout
exchanges (issue 32's benchmark; SGLang's large-scale EP blog, 2025-05-05, makes the same comparison):

- **TP** (``--tp-size N``): every rank holds all ``N T`` tokens; two all-reduces of ``[N T, H]`` a layer (after
  the attention's o-projection and after the MoE's down-projection). A ring all-reduce sends
  ``2 (N - 1) / N`` of the tensor from each rank.
- **DP attention, experts split by width** (``--enable-dp-attention``): a rank holds its ``T`` tokens; the MoE
  gathers every rank's tokens and reduce-scatters the partial outputs (`DPMoEGroup.dispatch` / ``combine``):
  each rank sends ``(N - 1) T`` rows twice.
- **DP attention + expert parallelism** (``--enable-expert-parallel``): each token goes once to each rank that
  holds one of its ``k`` experts, with its choices, and comes back (`DPMoEGroup.dispatch_routed` /
  ``combine_routed``): at most ``min(N, k)`` ranks a token, and its own rank costs nothing.

The exchanges run the engine's own `DPMoEGroup` methods and `TPGroup.all_reduce` between ``--ranks`` OS processes
over gloo, with routing drawn uniformly at random over the experts (a trained router is not uniform; the table
says so). Bytes are what leaves one rank per layer, counted from the split sizes (the all-reduce by its ring's
rule); times are wall-clock per layer on this machine's transport, which on CPU is loopback TCP: they rank the
layouts here, not on NVLink or RDMA. Per step: the per-layer numbers times ``--moe-layers``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

import torch

from pd_cluster.common.net import free_port

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """The exchange's shapes: hidden size H, routed experts E, experts per token k, MoE layers of a step."""

    hidden: int = 7168  # DeepSeek-V3
    experts: int = 256
    top_k: int = 8
    moe_layers: int = 58
    dtype: str = "bf16"


def _rank_main(rank: int, size: int, port: int, shape: Shape, tokens: list[int], iters: int, out) -> None:
    from pd_cluster.engine.parallel.dp_attention import DPMoEGroup
    from pd_cluster.engine.parallel.group import init_tp_group
    torch.set_num_threads(1)
    group = init_tp_group(rank, size, ("127.0.0.1", port), torch.device("cpu"), cls=DPMoEGroup)
    dtype, esize = DTYPES[shape.dtype], DTYPES[shape.dtype].itemsize
    gen = torch.Generator().manual_seed(1234 + rank)
    rows = []
    for t in tokens:
        x = torch.randn(t, shape.hidden, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(shape.experts, generator=gen)[:shape.top_k] for _ in range(t)])
        weights = torch.rand(t, shape.top_k, generator=gen)
        whole = torch.randn(size * t, shape.hidden, generator=gen).to(dtype)

        def tp_layer():
            group.all_reduce(whole.clone())
            group.all_reduce(whole.clone())

        def gather_layer():
            group.combine(group.dispatch(x))

        def routed_layer():
            received, _, _ = group.dispatch_routed(x, weights, ids, shape.experts // size)
            group.combine_routed(received, t)

        times = {name: _time(fn, iters, group) for name, fn in
                 (("tp", tp_layer), ("gather", gather_layer), ("routed", routed_layer))}
        owner = ids // (shape.experts // size)  # the rank holding each chosen expert
        send = torch.stack([(owner == r).any(dim=-1).sum() for r in range(size)])  # tokens to each rank
        every = group.all_gather(send)  # every rank's send counts: what comes back to it in the combine
        sent = int(send.sum() - send[rank])
        received = sum(int(every[r][rank]) for r in range(size) if r != rank)
        # dispatch: rows and their choices (k ids and k weights as float32) out; combine: received rows back
        routed_bytes = sent * (shape.hidden * esize + 2 * shape.top_k * 4) + received * shape.hidden * esize
        rows.append({
            "tokens": t,
            "tp_bytes": 2 * 2 * (size - 1) * size * t * shape.hidden * esize // size,
            "gather_bytes": 2 * (size - 1) * t * shape.hidden * esize,
            "routed_bytes": routed_bytes,
            **{f"{k}_ms": v for k, v in times.items()},
        })
    out.put((rank, rows))


def _time(fn, iters: int, group) -> float:
    """Median wall-clock ms of `fn` over `iters` runs, the ranks lined up before each."""
    fn()  # warm up: connections, buffers
    samples = []
    for _ in range(iters):
        group.all_reduce(torch.zeros(1))  # line the ranks up
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def measure(shape: Shape, ranks: int, tokens: list[int], iters: int) -> list[dict]:
    """Run the exchanges in `ranks` processes; per tokens-per-rank, the bytes one rank sends per layer (rank
    0's, and the largest over the ranks for the routed exchange) and the slowest rank's median ms per layer.

    Raises:
        RuntimeError: a rank process failed or did not answer within 10 minutes.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, shape, tokens, iters, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=600) for _ in procs)
    except Exception as e:
        raise RuntimeError(f"a rank did not answer: {e}") from e
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    merged = []
    for i, row in enumerate(results[0]):
        per_rank = [results[r][i] for r in range(ranks)]
        merged.append({**row, "routed_bytes": max(r["routed_bytes"] for r in per_rank),
                       **{k: max(r[k] for r in per_rank) for k in ("tp_ms", "gather_ms", "routed_ms")}})
    return merged


def table(shape: Shape, ranks: int, rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = [f"{ranks} ranks, H {shape.hidden}, {shape.experts} experts, top-{shape.top_k}, {shape.dtype}, "
             f"{shape.moe_layers} MoE layers a step; bytes sent by one rank (routed: the busiest rank)",
             "",
             "| tokens/rank | batch | TP all-reduce MiB/step | DP gather MiB/step | DP+EP all-to-all MiB/step "
             "| EP / TP bytes | TP ms/layer | gather ms/layer | EP ms/layer |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        steps = shape.moe_layers
        lines.append(f"| {r['tokens']} | {r['tokens'] * ranks} | {r['tp_bytes'] * steps / mib:,.3f} "
                     f"| {r['gather_bytes'] * steps / mib:,.3f} | {r['routed_bytes'] * steps / mib:,.3f} "
                     f"| {r['routed_bytes'] / r['tp_bytes']:.2f} | {r['tp_ms']:.3f} | {r['gather_ms']:.3f} "
                     f"| {r['routed_ms']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens-per-rank", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--hidden", type=int, default=Shape.hidden)
    p.add_argument("--experts", type=int, default=Shape.experts)
    p.add_argument("--top-k", type=int, default=Shape.top_k)
    p.add_argument("--moe-layers", type=int, default=Shape.moe_layers)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny shapes and few iterations")
    args = p.parse_args(argv)
    shape = Shape(args.hidden, args.experts, args.top_k, args.moe_layers, args.dtype)
    tokens, iters = args.tokens_per_rank, args.iters
    if args.smoke:
        shape, tokens, iters = Shape(64, 8, 2, 2, "fp32"), [1, 4], 2
    if shape.experts % args.ranks:
        p.error(f"--experts {shape.experts} must divide over --ranks {args.ranks}")
    print(table(shape, args.ranks, measure(shape, args.ranks, tokens, iters)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
