"""`pd-plan` for one tensor-parallel instance over several nodes (``--tp-size 16 --nnodes 2``, SGLang's multi-node
TP; the engine's `pd_cluster.engine.parallel.nodes`): DeepSeek-V3 as released (FP8 blocks) does not fit one node of
8 x 80 GiB GPUs, and does fit TP 16 over two; the numbers by hand, the suggestion that names the flags, and the
layouts refused by flag."""

from __future__ import annotations

import pytest

from pd_cluster.engine.planner.plan import PlanInput, make_plan, suggestions
from pd_cluster.engine.planner.spec import load_spec
from test_planner_wide_ep import _row, _run

GPU_80 = 80 * 2**30


def test_deepseek_v3_over_two_80gib_nodes_by_hand():
    spec = load_spec("deepseek-v3")
    one = make_plan(spec, PlanInput(tp_size=8, gpu_memory=GPU_80))
    assert not one.weights_fit  # 82 GiB of weights a GPU at TP 8 against a 70.4 GiB static budget
    two = make_plan(spec, PlanInput(tp_size=16, nnodes=2, gpu_memory=GPU_80))
    assert two.inp.ranks_per_node == 8 and two.instances_per_node == 1
    assert two.weights_per_gpu == spec.weight_bytes(2, 16)
    assert two.pool_per_gpu == int(GPU_80 * 0.88) - two.weights_per_gpu
    assert two.kv_bytes_per_token_per_gpu == 61 * 576 * 2  # the MLA latent, on every rank, bf16
    assert two.tokens_per_instance == two.pool_per_gpu // (61 * 576 * 2) // 64 * 64
    assert two.tokens_per_node == two.tokens_per_instance // 2  # the instance is half on each node
    assert two.fits


def test_the_suggestion_names_tp_over_nodes_and_the_plan_says_so(capsys):
    code, out, _ = _run(capsys, "--model", "deepseek-v3", "--gpu-memory", "80GiB", "--tp-size", "8")
    assert code == 0
    two = make_plan(load_spec("deepseek-v3"), PlanInput(tp_size=16, nnodes=2, gpu_memory=GPU_80))
    assert _row(out, "to make it fit") == (f"more TP: --tp-size 16 --nnodes 2 gives {two.tokens_per_instance:,} "
                                           "tokens (fits)")
    code, out, _ = _run(capsys, "--model", "deepseek-v3", "--gpu-memory", "80GiB", "--tp-size", "16", "--nnodes", "2")
    assert code == 0
    assert _row(out, "deployment").startswith("TP 16 over 2 nodes (8 ranks a node), 8 GPUs/node x 80.00 GiB")
    assert _row(out, "pool tokens per GPU / instance") == f"{two.tokens_per_instance:,}"
    assert _row(out, "asked context") == "131,072 tokens: fits one TP-16 instance"
    assert _row(out, "131,072-token requests at once").endswith("per 2 nodes (KV pool only)")
    assert _row(out, "engine support").startswith("yes (DeepseekV3ForCausalLM")


def test_a_small_gpu_tries_one_node_then_two():
    """Llama 3.1 70B in bf16 on 24 GiB GPUs: TP 8 leaves no pool; the tips go to TP 8, then TP 16 over 2 nodes."""
    plan = make_plan(load_spec("llama-3.1-70b"), PlanInput(tp_size=4, gpu_memory=24 * 2**30))
    tips = [t for t in suggestions(plan) if t.startswith("more TP")]
    assert [t.split(" gives")[0] for t in tips] == ["more TP: --tp-size 8", "more TP: --tp-size 16 --nnodes 2"]
    assert tips[-1].endswith("(fits)")


@pytest.mark.parametrize("kwargs, message", [
    ({"tp_size": 16}, "--tp-size 16 over --nnodes 1 is 16 ranks a node, more than its 8 GPUs: raise --nnodes"),
    ({"tp_size": 16, "nnodes": 3}, "--nnodes 3 must divide --tp-size 16"),
    ({"tp_size": 12, "nnodes": 2}, "--tp-size 12 is 6 ranks a node, which does not divide a node's 8 GPUs"),
    ({"tp_size": 0}, "--tp-size must be >= 1"),
])
def test_layouts_the_engine_cannot_start_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PlanInput(**kwargs)
