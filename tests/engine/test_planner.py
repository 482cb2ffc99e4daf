"""Acceptance: `pd-plan` prints the sizing numbers, and they match hand computations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_cluster.engine.planner.cli import main
from pd_cluster.engine.planner.plan import PlanInput, make_plan
from pd_cluster.engine.planner.spec import BUNDLED, load_spec


def test_llama_3_1_8b_fp8_bytes_per_token_by_hand():
    plan = make_plan(load_spec("llama-3.1-8b"), PlanInput(kv_cache_dtype="fp8_e4m3"))
    assert plan.kv_bytes_per_token == 32 * 8 * 128 * 2 * 1 == 65_536
    assert plan.kv_bytes_per_token_per_gpu == 65_536  # TP 1: all 8 KV heads on one GPU
    bf16 = make_plan(load_spec("llama-3.1-8b"), PlanInput(kv_cache_dtype="bf16"))
    assert bf16.kv_bytes_per_token == 131_072


def test_weights_and_capacity_by_hand():
    spec = load_spec("llama-3.1-8b")
    assert abs(spec.num_params() - 8.03e9) < 0.01e9  # Meta's model card: 8.03B
    inp = PlanInput(tp_size=2, gpu_memory=100 * 2**30, mem_fraction_static=0.9, page_size=64)
    plan = make_plan(spec, inp)
    assert plan.weights_per_gpu == spec.num_params() * 2 // 2
    assert plan.pool_per_gpu == int(100 * 2**30 * 0.9) - plan.weights_per_gpu
    assert plan.kv_bytes_per_token_per_gpu == 32 * 4 * 128 * 2  # 4 KV heads per GPU
    assert plan.tokens_per_instance == plan.pool_per_gpu // (32 * 4 * 128 * 2) // 64 * 64
    assert plan.tokens_per_node == 4 * plan.tokens_per_instance


def test_tp_beyond_kv_heads_replicates():
    plan = make_plan(load_spec("llama-3.1-70b"), PlanInput(tp_size=8))
    assert plan.kv_heads_per_gpu == 1
    spec = load_spec("qwen2.5-72b")
    assert make_plan(spec, PlanInput(tp_size=8)).kv_heads_per_gpu == 1


def test_llama_4_scout_10m_context_on_one_h200_node():
    spec = load_spec("llama-4-scout")
    assert (spec.global_layers, spec.local_layers, spec.attention_chunk_size) == (12, 36, 8192)
    assert abs(spec.num_params() - 108e9) < 2e9  # 109B total with the vision tower
    plan = make_plan(spec, PlanInput(tp_size=8, context_length=10_000_000, kv_cache_dtype="fp8_e4m3"))
    assert plan.kv_bytes_per_token == 48 * 8 * 128 * 2 == 98_304
    assert plan.kv_bytes_per_token_per_gpu == 12 * 1 * 128 * 2 == 3_072
    assert plan.fits and plan.tokens_per_instance > 10_000_000


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_prints_every_number_for_bundled_configs(name, capsys):
    assert main(["--model", name, "--tp-size", "8", "--context-length", "10000000"]) == 0
    text = capsys.readouterr().out
    for row in ("KV bytes/token (model)", "KV bytes/token (per GPU)", "weights per GPU", "pool tokens per GPU",
                "pool tokens per node", "longest single request", "asked context", "start-up"):
        assert row in text, row


def test_suggests_fixes_when_it_does_not_fit(capsys):
    assert main(["--model", "llama-3.1-70b", "--tp-size", "2", "--kv-cache-dtype", "bf16",
                 "--context-length", "1000000"]) == 0
    text = capsys.readouterr().out
    assert "does NOT fit" in text
    assert "more TP: --tp-size 8" in text and "FP8 KV" in text and "host tier" in text


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "pd_cluster.engine.planner.cli", "--model", "llama-3.1-8b"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert "65,536 B" in out.stdout


def test_bad_input_is_a_clean_error(capsys):
    assert main(["--model", "no-such-model"]) == 2
    assert "neither a bundled config" in capsys.readouterr().err
