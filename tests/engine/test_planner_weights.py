"""Acceptance: `pd-plan` when the weights alone exceed the static budget, and for weights the engine cannot hold."""

from __future__ import annotations

from pd_cluster.engine.planner.cli import main
from pd_cluster.engine.planner.plan import PlanInput, make_plan
from pd_cluster.engine.planner.spec import load_spec


def _render(*argv: str, capsys) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name + " "))


def test_weights_beyond_the_static_budget_say_the_engine_cannot_start(capsys):
    """DeepSeek-V3 at TP 8 on 80 GiB GPUs (H100 class): its dense layers and routed experts in FP8 take 82.43 GiB a
    GPU, above 0.88 x 80 GiB. The planner names the overshoot instead of printing a negative pool, says the engine
    does not start, and suggests no KV setting (none can help)."""
    spec = load_spec("deepseek-v3")
    plan = make_plan(spec, PlanInput(tp_size=8, gpu_memory=80 * 2**30))
    budget = int(80 * 2**30 * 0.88)
    assert plan.static_budget_per_gpu == budget and plan.pool_per_gpu == budget - spec.weight_bytes(2, 8) < 0
    assert not plan.weights_fit and plan.tokens_per_instance == 0
    h100 = ("--model", "deepseek-v3", "--gpu-memory", "80GiB")
    text = _render(*h100, "--tp-size", "8", capsys=capsys)
    assert _row(text, "KV pool per GPU").split("  ")[-1].strip() == (
        "none: the weights (82.43 GiB) exceed the static budget (70.40 GiB: mem_fraction_static 0.88 x "
        "80.00 GiB) by 12.03 GiB")
    assert "-" not in _row(text, "KV pool per GPU").split("GPU", 1)[1]
    tips = [line for line in text.splitlines() if line.startswith("to make it fit")]
    # the weights leave no pool on one node of 80 GiB GPUs; TP over two nodes does (tests/engine/test_planner_nodes.py)
    assert len(tips) == 1 and "more TP: --tp-size 16 --nnodes 2 gives" in tips[0] and tips[0].endswith("(fits)")
    assert "668.0B of 671.0B parameters kept quantised" in _row(text, "engine support")
    assert "FP8 KV" not in text
    assert _row(text, "start-up").endswith("the engine does not start with this deployment, whatever --context-length")
    # at TP 4 on the same node, more TP is named, with its honest verdict
    tips = [line for line in _render(*h100, "--tp-size", "4", capsys=capsys).splitlines()
            if line.startswith("to make it fit")]
    assert tips[0].endswith("more TP: --tp-size 8 gives 0 tokens (the weights still do not fit)")
    # a model whose weights fit only with a larger static share: the planner says which share
    text = _render("--model", "llama-3.1-70b", "--tp-size", "1", "--gpu-memory", "145GiB", capsys=capsys)
    need = load_spec("llama-3.1-70b").num_params() * 2 / (145 * 2**30)
    assert 0.88 < need < 1
    assert f"--mem-fraction-static must exceed {need:.2f} before any KV page fits" in text


def test_fp8_weights_are_a_what_if_the_engine_cannot_serve(capsys):
    """The engine does not quantise unquantised weights on load: sizing with --dtype fp8 says so."""
    text = _render("--model", "deepseek-v3", "--tp-size", "8", "--dtype", "fp8", capsys=capsys)
    assert "NO: --dtype fp8: the engine does not quantise unquantised weights on load" in _row(text, "engine support")
    assert "NOT SERVABLE by this engine" in _row(text, "asked context")
    assert "NO:" not in _row(_render("--model", "deepseek-v3", "--tp-size", "8", capsys=capsys), "engine support")
