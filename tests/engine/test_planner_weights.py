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
    """DeepSeek-V3 at TP 8 while its routed experts load dequantised to bf16 (the dense layers stay FP8):
    158.54 GiB a GPU exceeds 0.88 x 140.40 GiB. The planner names the overshoot instead of printing a negative pool,
    says the engine does not start, and suggests no KV setting (none can help)."""
    spec = load_spec("deepseek-v3")
    plan = make_plan(spec, PlanInput(tp_size=8))
    budget = int(143771 * 2**20 * 0.88)
    assert plan.static_budget_per_gpu == budget and plan.pool_per_gpu == budget - spec.weight_bytes(2, 8) < 0
    assert not plan.weights_fit and plan.tokens_per_instance == 0
    text = _render("--model", "deepseek-v3", "--tp-size", "8", capsys=capsys)
    assert _row(text, "KV pool per GPU").split("  ")[-1].strip() == (
        "none: the weights (158.54 GiB) exceed the static budget (123.55 GiB: mem_fraction_static 0.88 x "
        "140.40 GiB) by 34.99 GiB")
    assert "-" not in _row(text, "KV pool per GPU").split("GPU", 1)[1]
    tips = [line for line in text.splitlines() if line.startswith("to make it fit")]
    assert len(tips) == 1 and "none the engine offers: the bf16 weights need 158.54 GiB per GPU at TP 8" in tips[0]
    assert "the routed experts' fp8 is dequantised to the model dtype on load" in tips[0]
    assert "FP8 KV" not in text
    assert _row(text, "start-up").endswith("the engine does not start with this deployment, whatever --context-length")
    # at TP 4 on the same node, more TP is named, with its honest verdict
    tips = [line for line in _render("--model", "deepseek-v3", "--tp-size", "4", capsys=capsys).splitlines()
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
