"""`pd-plan` for a wide expert-parallel decode (`pd_cluster.engine.planner.wide_ep`): DeepSeek-V3 as released (FP8
blocks) at ``--tp-size 16 --dp-size 16 --enable-dp-attention --enable-expert-parallel --nnodes 2`` on two 8 x H200
nodes: memory per GPU, KV tokens per DP rank, the all-to-all bytes of a decode step; and the layouts it refuses,
each naming its flag."""

from __future__ import annotations

import dataclasses

import pytest

from pd_cluster.engine.planner import cli
from pd_cluster.engine.planner.plan import PlanInput
from pd_cluster.engine.planner.spec import load_spec
from pd_cluster.engine.planner.weights import weight_bytes
from pd_cluster.engine.planner.wide_ep import WideEPInput, plan_wide_ep

WIDE = ["--model", "deepseek-v3", "--role", "decode", "--tp-size", "16", "--dp-size", "16", "--enable-dp-attention",
        "--enable-expert-parallel", "--nnodes", "2"]
H200_BUDGET = int(143771 * 2**20 * 0.88)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _row(text: str, key: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(key + " "))[len(key):].strip()


def test_deepseek_v3_dp16_ep16_on_two_nodes():
    spec = load_spec("deepseek-v3")
    plan = plan_wide_ep(spec, WideEPInput(PlanInput(), tp_size=16, dp_size=16, nnodes=2))
    # against TP 16 (attention split 16 ways), DP attention holds every attention projection whole on each rank:
    # q_b_proj (1536 -> 128 x 192) and o_proj (128 x 128 -> 7168) in 128x128 FP8 blocks, kv_b_proj (512 -> 128 x
    # (128 + 128)) dequantised to bf16; 61 layers, each 15/16 more of them
    fp8 = (1536 * 128 * 192 + 128 * 128 * 7168) * (1 + 4 / 16384)
    bf16 = 512 * 128 * 256 * 2
    tp16 = weight_bytes(spec.arch, spec.quant, 2, 16)
    assert plan.weights.total - tp16.total == pytest.approx(61 * (fp8 + bf16) * 15 / 16, rel=1e-6)
    # the routed experts: 16 whole experts a rank of 58 MoE layers x 3 x 7168 x 2048 FP8 weights
    assert plan.weights.quantized >= 58 * 16 * 3 * 7168 * 2048
    assert plan.pool_per_gpu == H200_BUDGET - plan.weights.total > 60 * 2**30
    # MLA: one 576-wide bf16 latent per token per layer, the same on each rank of a DP group (here one rank)
    assert plan.kv_bytes_per_token_per_gpu == 61 * 576 * 2
    assert plan.tokens_per_dp_rank == plan.pool_per_gpu // (61 * 576 * 2) // 64 * 64 > 1_000_000
    assert plan.tokens_per_instance == 16 * plan.tokens_per_dp_rank
    # 128 tokens a rank, top 8, 15/16 of the copies leave the rank: FP8 dispatch (7168 + 56 scales x 4 B) and bf16
    # combine (7168 x 2 B), 58 MoE layers
    assert plan.all_to_all_bytes_per_step == 58 * 128 * 8 * (7168 + 56 * 4 + 7168 * 2) * 15 // 16
    # a TP-16 instance on the same 2,048 tokens all-reduces 2 bf16 [2048, 7168] tensors a layer, 61 layers, ring
    assert plan.all_reduce_bytes_per_step == 2 * 61 * 2048 * 7168 * 2 * 2 * 15 // 16
    assert plan.all_reduce_bytes_per_step > 5 * plan.all_to_all_bytes_per_step


def test_redundant_experts_add_their_whole_experts_to_each_rank(capsys):
    """EPLB's ``--ep-num-redundant-experts 32`` over EP 16: two more whole FP8 experts a rank in each of the 58 MoE
    layers (3 x 7168 x 2048 weights each, with their 128 x 128 block scales), and nothing else."""
    spec = load_spec("deepseek-v3")
    base = WideEPInput(PlanInput(), tp_size=16, dp_size=16, nnodes=2)
    plain = plan_wide_ep(spec, base)
    eplb = plan_wide_ep(spec, dataclasses.replace(base, num_redundant_experts=32))
    assert eplb.weights.quantized - plain.weights.quantized == pytest.approx(
        58 * 2 * 3 * 7168 * 2048 * (1 + 4 / 16384), rel=1e-6)
    assert (eplb.weights.plain, eplb.weights.replicated) == (plain.weights.plain, plain.weights.replicated)
    assert eplb.pool_per_gpu == plain.pool_per_gpu - (eplb.weights.total - plain.weights.total)
    code, out, _ = _run(capsys, *WIDE, "--ep-num-redundant-experts", "32")
    assert code == 0 and "EP 16: 18 whole experts a rank (32 redundant over the instance, EPLB)" in _row(out, "deployment")


def test_pd_plan_prints_the_wide_ep_decode_and_what_the_engine_lacks(capsys):
    code, out, _ = _run(capsys, *WIDE)
    assert code == 0
    assert _row(out, "KV tokens per DP rank").replace(",", "").isdigit()
    assert _row(out, "attention").startswith("16 DP groups of 1 rank(s)")
    assert "EP 16: 16 whole experts a rank, 2 node(s) x 8 GPUs" in _row(out, "deployment")
    assert "MiB sent per rank at 128 tokens a DP rank" in _row(out, "all-to-all per decode step")
    support = _row(out, "engine support")
    assert support.startswith("NOT SERVABLE") and "--nnodes 2" in support
    # the prefill side of the same deployment: one TP-8 instance, as any plan
    code, out, _ = _run(capsys, "--model", "deepseek-v3", "--role", "prefill", "--tp-size", "8")
    assert code == 0 and _row(out, "asked context").endswith("fits one TP-8 instance")


@pytest.mark.parametrize("argv, message", [
    (["--dp-size", "3"], "--dp-size 3 must divide --tp-size 16"),
    (["--dp-size", "1"], "--enable-dp-attention needs --dp-size > 1"),
    (["--nnodes", "1"], "--tp-size 16 over --nnodes 1 is 16 ranks a node, more than its 8 GPUs: raise --nnodes"),
    (["--nnodes", "3"], "--nnodes 3 must divide --tp-size 16"),
    (["--decode-batch-per-rank", "0"], "--decode-batch-per-rank must be >= 1"),
    (["--ep-num-redundant-experts", "8"], "--ep-num-redundant-experts 8: the 256 experts and the redundant ones must "
                                          "be a multiple of --tp-size 16"),
])
def test_a_layout_that_cannot_be_built_is_refused_naming_its_flag(capsys, argv, message):
    code, out, err = _run(capsys, *WIDE, *argv)
    assert code == 2 and out == "" and message in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen3-30b-a3b", "--tp-size", "12", "--dp-size", "12", "--enable-dp-attention",
      "--enable-expert-parallel", "--nnodes", "2"], "--enable-expert-parallel: 128 experts do not divide over "
                                                     "--tp-size 12 ranks"),
    (["--model", "llama-3.1-8b", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
     "llama-3.1-8b is dense"),
    (["--model", "llama-3.1-8b", "--dp-size", "2"], "--dp-size 2 without --enable-dp-attention"),
    (["--model", "deepseek-v3", "--tp-size", "8", "--ep-num-redundant-experts", "8"],
     "--ep-num-redundant-experts is planned for a wide-EP instance"),
    (["--model", "llama-3.1-70b", "--tp-size", "16"], "--tp-size 16 over --nnodes 1 is 16 ranks a node, more than "
                                                      "its 8 GPUs: raise --nnodes"),
    (["--model", "llama-3.1-70b", "--nnodes", "2"], "--nnodes 2 must divide --tp-size 1"),
    (["--model", "llama-3.1-70b", "--tp-size", "12", "--nnodes", "2"], "--tp-size 12 is 6 ranks a node, which does "
                                                                       "not divide a node's 8 GPUs"),
])
def test_other_models_and_flags_refused_by_name(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "" and message in err
