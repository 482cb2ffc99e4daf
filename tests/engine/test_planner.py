"""Acceptance: `pd-plan` prints the sizing numbers, and they match hand computations."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pd_cluster.engine.planner.cli import main
from pd_cluster.engine.planner.limits import (DEFAULT_PREFILL_TFLOPS, SUPPORTED_ROPE_TYPES, context_limit,
                                              prefill_flops, prefill_seconds, unsupported_reason)
from pd_cluster.engine.planner.plan import PlanInput, make_plan
from pd_cluster.engine.planner.spec import BUNDLED, load_spec, spec_from_config


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
    assert inp.kv_dtype == "bf16"  # --kv-cache-dtype auto, the engine's default: the model's dtype
    assert plan.kv_bytes_per_token_per_gpu == 32 * 4 * 128 * 2 * 2  # 4 KV heads per GPU
    assert plan.tokens_per_instance == plan.pool_per_gpu // (32 * 4 * 128 * 2 * 2) // 64 * 64
    assert plan.tokens_per_node == 4 * plan.tokens_per_instance


def test_tp_beyond_kv_heads_replicates():
    plan = make_plan(load_spec("llama-3.1-70b"), PlanInput(tp_size=8))
    assert plan.kv_heads_per_gpu == 1
    spec = load_spec("qwen2.5-72b")
    assert make_plan(spec, PlanInput(tp_size=8)).kv_heads_per_gpu == 1


def test_llama_4_scout_10m_context_on_one_h200_node():
    """The engine's own defaults (mixed role, --kv-cache-dtype auto = bf16): the 36 chunked layers hold only
    their chunk plus a prefill chunk (KV groups of 12 layers), so a token costs the 12 global layers' KV and 10M
    tokens fit one TP-8 H200 instance, in a mixed-role worker and in a PD decode worker alike (a PD transfer moves
    only the chunked layers' window). With the hierarchical cache (one group) every layer's KV stays and 10M does
    not fit."""
    spec = load_spec("llama-4-scout")
    assert (spec.global_layers, spec.local_layers, spec.local_span, spec.local_kind) == (12, 36, 8192, "chunked")
    assert abs(spec.num_params() - 108e9) < 2e9  # 109B total with the vision tower
    inp = PlanInput(tp_size=8, context_length=10_000_000)
    plan = make_plan(spec, inp)
    assert inp.kv_dtype == "bf16" and plan.window_kv and plan.page_layers == 12
    assert plan.kv_bytes_per_token == 48 * 8 * 128 * 2 * 2 == 196_608
    assert plan.kv_bytes_per_token_per_gpu == 12 * 1 * 128 * 2 * 2 == 6_144
    assert plan.local_tokens == (-(-(8191 + 8192) // 64) + 1) * 64 == 16_448
    assert plan.local_kv_bytes_per_gpu == 36 * 128 * 2 * 2 * 16_448
    assert plan.fits and plan.tokens_per_instance > 10_000_000
    assert plan.tokens_per_instance == (plan.pool_per_gpu - plan.local_kv_bytes_per_gpu) // 6_144 // 64 * 64
    decode = make_plan(spec, PlanInput(tp_size=8, context_length=10_000_000, role="decode"))
    assert decode.window_kv and decode.tokens_per_instance == plan.tokens_per_instance and decode.fits
    one = make_plan(spec, PlanInput(tp_size=8, context_length=10_000_000, role="decode",
                                    enable_hierarchical_cache=True))
    assert not one.window_kv and one.kv_bytes_per_token_per_gpu == 48 * 128 * 2 * 2 and not one.fits
    fp8 = make_plan(spec, PlanInput(tp_size=8, context_length=10_000_000, kv_cache_dtype="fp8_e4m3"))
    assert fp8.kv_bytes_per_token_per_gpu == 12 * 128 * 2 == 3_072 and fp8.fits


@pytest.mark.parametrize("name", ["llama-4-scout", "gemma-3-1b", "gemma-2-9b", "gpt-oss-120b"])
def test_window_arithmetic_is_the_engines(name):
    """The planner's KV bytes of one request equal the engine's: the groups `plan_kv_groups` forms from the
    loader's per-layer description, each holding `KVGroup.max_pages` pages of `layers_per_page` layers."""
    from pd_cluster.engine.kv.groups import plan_kv_groups
    from pd_cluster.engine.model.arch import ArchConfig

    cfg = json.loads(BUNDLED[name].read_text())
    if name == "gpt-oss-120b":
        del cfg["quantization_config"]
    arch = ArchConfig.from_dict(cfg)
    groups = plan_kv_groups(arch.layer_attention)
    spec = load_spec(name)
    inp = PlanInput(tp_size=8, page_size=64, chunked_prefill_size=4096)
    plan = make_plan(spec, inp)
    assert plan.window_kv and plan.page_layers == groups.layers_per_page
    heads = max(spec.num_kv_heads // 8, 1)
    page_bytes = groups.layers_per_page * heads * 64 * spec.head_dim * 2 * 2  # bf16 K and V
    for tokens in (64, 4096, 100_032, 1_000_000 // 64 * 64):
        assert plan.kv_bytes_for(tokens) == groups.max_pages(tokens, 4096, 64) * page_bytes, tokens


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
    assert "more TP: --tp-size 8" in text and "FP8 KV" in text
    assert "host" not in text  # the engine keeps a running request's KV on its GPUs: nothing to suggest there


@pytest.mark.slow
def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "pd_cluster.engine.planner.cli", "--model", "llama-3.1-8b"], capture_output=True,
                         text=True, timeout=60, check=True)
    assert "131,072 B" in out.stdout  # bf16 KV: --kv-cache-dtype auto, as the engine


def test_bad_input_is_a_clean_error(capsys):
    assert main(["--model", "no-such-model"]) == 2
    assert "neither a bundled config" in capsys.readouterr().err


# --- what the engine can serve, the model's context limit, prefill time -------------------------------

def _render(*argv: str, capsys) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _row(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name + " "))


def test_llama_4_scout_is_servable_and_says_what_its_pool_holds(capsys):
    text = _render("--model", "llama-4-scout", "--tp-size", "8", "--context-length", "10000000", capsys=capsys)
    assert _row(text, "engine support").split()[2:4] == ["yes", "(Llama4ForConditionalGeneration,"]
    assert "kv_cache_dtype auto (bf16)" in _row(text, "deployment")
    assert _row(text, "KV bytes/token (per GPU)").startswith(
        "KV bytes/token (per GPU)                 6,144 B (1 KV head(s) x 12 global layers; the 36 chunked layers "
        "hold only their window (KV groups of 12 layers a page))")
    assert "36 chunked layers x 16,448 tokens" in _row(text, "chunked KV per GPU")
    assert _row(text, "asked context").endswith("fits one TP-8 instance")
    assert "to make it fit" not in text and "host" not in text
    assert unsupported_reason(load_spec("llama-4-scout")) is None
    decode = _render("--model", "llama-4-scout", "--tp-size", "8", "--context-length", "10000000",
                     "--role", "decode", capsys=capsys)
    assert "the 36 chunked layers hold only their window" in _row(decode, "KV bytes/token (per GPU)")
    assert _row(decode, "asked context").endswith("fits one TP-8 instance")
    hicache = _render("--model", "llama-4-scout", "--tp-size", "8", "--context-length", "10000000",
                      "--role", "decode", "--enable-hierarchical-cache", capsys=capsys)
    assert "the hierarchical cache keeps one KV group" in _row(hicache, "KV bytes/token (per GPU)")
    assert _row(hicache, "asked context").endswith("does NOT fit one TP-8 instance")
    tips = [line for line in hicache.splitlines() if line.startswith("to make it fit")]
    assert any("window pages freed: without --enable-hierarchical-cache" in t and "(fits)" in t for t in tips)


def test_suggestions_name_only_what_the_engine_does(capsys):
    """At TP 8 with FP8 KV and window pages freed, 2M tokens of Llama 3.1 70B still do not fit: the planner
    says so instead of proposing host-memory offload or context parallelism, which the engine does not do."""
    text = _render("--model", "llama-3.1-70b", "--tp-size", "8", "--kv-cache-dtype", "fp8_e4m3",
                   "--context-length", "20000000", capsys=capsys)
    tips = [line for line in text.splitlines() if line.startswith("to make it fit")]
    assert len(tips) == 1 and "none the engine offers" in tips[0] and "no live offload" in tips[0]


@pytest.mark.parametrize("name, layers, total, active", [
    ("gemma-2-9b", (21, 21, 4096, "sliding"), 9.2417e9, None),   # Google: 9.24B
    ("gemma-3-1b", (4, 22, 512, "sliding"), 0.9999e9, None),     # Google: 1B (999.9M)
    ("gpt-oss-120b", (18, 18, 128, "sliding"), 116.83e9, 5.13e9),  # OpenAI: 116.83B total, 5.13B active
])
def test_hybrid_families_layers_and_parameters(name, layers, total, active, capsys):
    """The layer counts come from the loader's own per-layer description; the parameter counts from its
    ArchConfig (Gemma's four norms and q/k norms, gpt-oss's biases, sinks and expert biases counted)."""
    spec = load_spec(name)
    assert (spec.global_layers, spec.local_layers, spec.local_span, spec.local_kind) == layers
    assert abs(spec.num_params() - total) < 0.005e9, spec.num_params()
    if active:  # OpenAI counts the unembedding, not the embedding table (a lookup)
        assert abs(spec.active_params() - spec.vocab_size * spec.hidden_size - active) < 0.01e9
    plan = make_plan(spec, PlanInput(tp_size=8, kv_cache_dtype="fp8_e4m3", role="decode",
                                     enable_hierarchical_cache=True))  # one group: every layer
    assert plan.kv_bytes_per_token_per_gpu == spec.num_layers * max(spec.num_kv_heads // 8, 1) * spec.head_dim * 2
    text = _render("--model", name, "--tp-size", "8", capsys=capsys)
    assert f"{layers[1]} sliding" in _row(text, "model")


def test_gpt_oss_released_mxfp4_weights_are_supported(capsys):
    """Its experts stay MXFP4 (`docs/moe.md`); the same model with unquantised (e.g. bf16) weights loads too."""
    text = _render("--model", "gpt-oss-120b", "--tp-size", "8", capsys=capsys)
    assert _row(text, "engine support").split()[2] == "yes"
    cfg = json.loads(BUNDLED["gpt-oss-120b"].read_text())
    del cfg["quantization_config"]
    assert unsupported_reason(spec_from_config(cfg, "gpt-oss-120b-bf16")) is None


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-72b", "mixtral-8x7b", "qwen3-30b-a3b",
                                  "phi-3-mini-4k", "deepseek-v3", "gemma-2-9b", "gemma-3-1b", "llama-4-scout"])
def test_supported_models_say_so(name, capsys):
    assert unsupported_reason(load_spec(name)) is None
    assert _row(_render("--model", name, capsys=capsys), "engine support").split()[2] == "yes"


@pytest.mark.parametrize("name, total, active", [("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                                  ("llama-4-scout", 107.8e9, 17.2e9)])
def test_moe_total_and_active_parameters_match_the_model_cards(name, total, active, capsys):
    """Mistral: 46.7B total, 12.9B active; Qwen: 30.5B, 3.3B; Meta: 17B active (109B with the vision tower)."""
    spec = load_spec(name)
    assert abs(spec.num_params() - total) < 0.06e9 and abs(spec.active_params() - active) < 0.06e9
    assert f"{spec.active_params() / 1e9:.2f}B active" in _row(_render("--model", name, capsys=capsys), "model")


def test_mixtral_has_no_shared_expert_and_qwen3_moe_every_layer_sparse():
    mixtral, qwen = load_spec("mixtral-8x7b"), load_spec("qwen3-30b-a3b")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.shared_experts, mixtral.moe_layers) == (8, 2, 0, 32)
    assert (qwen.num_experts, qwen.experts_per_token, qwen.expert_intermediate_size, qwen.moe_layers) == (128, 8, 768, 48)


def test_a_config_key_the_engine_refuses_is_not_servable(capsys):
    cfg = json.loads(BUNDLED["mixtral-8x7b"].read_text())
    reason = unsupported_reason(spec_from_config({**cfg, "hidden_act": "gelu"}, "x"))
    assert reason and "hidden_act='gelu'" in reason


def test_planner_agrees_with_the_engines_loader():
    """A config the planner calls servable loads in ArchConfig; one it refuses, ArchConfig refuses."""
    import json

    from pd_cluster.engine.model.arch import ArchConfig

    for name, path in BUNDLED.items():
        cfg = json.loads(path.read_text())
        if unsupported_reason(load_spec(name)) is None:
            ArchConfig.from_dict(cfg)
        else:
            with pytest.raises(ValueError, match="unsupported architectures|mixture-of-experts layers|is not implemented|"
                                                 "is not supported"):
                ArchConfig.from_dict(cfg)


def test_rope_types_match_the_engines():
    from pd_cluster.engine.model.rope import rope_parameters

    base = {"factor": 4.0, "original_max_position_embeddings": 1024, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
    for kind in SUPPORTED_ROPE_TYPES:
        rope_parameters(64, 10000.0, {**base, "rope_type": kind}, 4096)  # accepted
    with pytest.raises(ValueError, match="unsupported rope_type"):
        rope_parameters(64, 10000.0, {**base, "rope_type": "ntk-by-parts"}, 4096)
    cfg = json.loads(BUNDLED["llama-3.1-8b"].read_text())
    cfg["rope_scaling"] = {"rope_type": "ntk-by-parts", "factor": 4.0}
    assert "rope_scaling type 'ntk-by-parts'" in unsupported_reason(spec_from_config(cfg, "x"))


def test_llama_3_1_8b_at_200k_is_beyond_its_context(capsys):
    text = _render("--model", "llama-3.1-8b", "--context-length", "200000", capsys=capsys)
    assert _row(text, "asked context").startswith(
        "asked context                         200,000 tokens: BEYOND the model's 131,072-token context limit")
    assert "131,072 tokens (max_position_embeddings 131,072, llama3 RoPE from 8,192)" in text
    at_limit = _render("--model", "llama-3.1-8b", "--context-length", "131072", capsys=capsys)
    assert "BEYOND" not in at_limit and "fits one TP-1 instance" in _row(at_limit, "asked context")


@pytest.mark.parametrize("scaling,limit", [
    (None, 32_768),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}, 131_072),
    ({"type": "yarn", "factor": 2.0}, 65_536),  # no original: max_position_embeddings x factor
    ({"rope_type": "linear", "factor": 2.0}, 65_536),
    ({"rope_type": "dynamic", "factor": 3.0}, 98_304),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 32_768),
])
def test_context_limit_takes_rope_scaling_into_account(scaling, limit):
    cfg = json.loads(BUNDLED["qwen2.5-72b"].read_text())  # max_position_embeddings 32,768
    if scaling:
        cfg["rope_scaling"] = scaling
    assert context_limit(spec_from_config(cfg, "q")).tokens == limit


def test_prefill_flops_by_hand():
    spec = load_spec("llama-3.1-8b")
    h, L = 4096, 100_000
    attn_params = h * 128 * (32 + 16) + 32 * 128 * h
    active = 32 * (attn_params + 2 * h + 3 * h * 14336)
    assert spec.active_params_per_token() == active
    assert prefill_flops(spec, L) == 2 * active * L + 2 * (32 * 128) * L * L * 32
    assert prefill_seconds(spec, L, 2, 500.0) == pytest.approx(prefill_flops(spec, L) / (2 * 500e12))
    scout = load_spec("llama-4-scout")  # 1 routed + 1 shared expert of 16; chunked layers see 8,192 tokens
    moe = 2 * 3 * 5120 * 8192 + 5120 * 16
    assert scout.active_params_per_token() == 48 * (scout._attention_params() + 2 * 5120 + moe)
    assert prefill_flops(scout, L) == pytest.approx(
        2 * scout.active_params_per_token() * L + 2 * 40 * 128 * L * (12 * L + 36 * 8192))


def test_prints_the_prefill_time_at_the_stated_rate_and_requests_at_once(capsys):
    text = _render("--model", "llama-3.1-8b", "--tp-size", "8", "--context-length", "131072",
                   "--prefill-tflops", "250", capsys=capsys)
    spec = load_spec("llama-3.1-8b")
    secs = prefill_seconds(spec, 131072, 8, 250.0)
    row = _row(text, "prefill of one 131,072-token request")
    assert f"~{secs:.1f} s" in row and "--prefill-tflops 250 per GPU x TP 8" in row
    plan = make_plan(spec, PlanInput(tp_size=8, context_length=131072))
    n = plan.pool_per_gpu // (131072 * plan.kv_bytes_per_token_per_gpu)
    assert n == plan.tokens_per_instance // 131072 > 1
    assert _row(text, "131,072-token requests at once").endswith(f"{n:,} per instance, {n:,} per node (KV pool only)")
    default = _render("--model", "llama-3.1-8b", capsys=capsys)
    assert f"--prefill-tflops {DEFAULT_PREFILL_TFLOPS:g} per GPU" in default


def test_bad_prefill_rate_is_a_clean_error(capsys):
    assert main(["--prefill-tflops", "0"]) == 2
    assert "--prefill-tflops must be > 0" in capsys.readouterr().err


def test_no_abbreviations(capsys):
    with pytest.raises(SystemExit):
        main(["--context", "1000"])
    assert "unrecognized arguments: --context" in capsys.readouterr().err


def test_host_tier_capacity_by_hand(capsys):
    spec = load_spec("llama-3.1-8b")
    plan = make_plan(spec, PlanInput(enable_hierarchical_cache=True, hicache_ratio=2.0, kv_cache_dtype="fp8_e4m3"))
    assert plan.host_tokens_per_instance == 2 * plan.tokens_per_instance  # the pool's tokens are whole pages
    assert plan.host_bytes_per_gpu == plan.host_tokens_per_instance * 65_536
    sized = make_plan(spec, PlanInput(enable_hierarchical_cache=True, hicache_size=100 * 10**9, page_size=64,
                                      kv_cache_dtype="fp8_e4m3"))
    assert sized.host_tokens_per_instance == 100 * 10**9 // 65_536 // 64 * 64 == 1_525_824
    assert make_plan(spec, PlanInput()).host_tokens_per_instance == 0  # no flag, no host tier
    assert main(["--model", "llama-3.1-8b", "--enable-hierarchical-cache", "--hicache-size", "100",
                 "--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "host tier tokens per instance         1,525,824 (--hicache-size 93.13 GiB per GPU" in out
    assert "host tier DRAM per node               745.03 GiB: within the node's 2,048.00 GiB" in out
    assert main(["--model", "llama-3.1-8b", "--enable-hierarchical-cache", "--hicache-ratio", "3",
                 "--host-memory", "1TiB", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert f"host tier tokens per instance         {3 * plan.tokens_per_instance:,} (--hicache-ratio 3 x" in out
    assert "BEYOND the node's 1,024.00 GiB" in out
    main(["--model", "llama-3.1-8b"])
    assert "host tier tokens" not in capsys.readouterr().out


def test_deepseek_v3_mla_bytes_and_parameters_by_hand(capsys):
    spec = load_spec("deepseek-v3")
    fp8 = make_plan(spec, PlanInput(tp_size=8, kv_cache_dtype="fp8_e4m3"))
    assert fp8.kv_bytes_per_token == 61 * 576 == 35_136  # one latent (512 + 64) per layer, not K and V per head
    assert fp8.kv_bytes_per_token_per_gpu == 35_136 and fp8.kv_heads_per_gpu == 1  # the same on every TP rank
    assert make_plan(spec, PlanInput(kv_cache_dtype="bf16")).kv_bytes_per_token == 61 * 576 * 2
    # attention per layer: q_a 7168x1536 (+ norm), q_b 1536x128x192, kv_a 7168x576 (+ norm), kv_b 512x128x256,
    # o 128x128x7168; 3 dense MLPs of 18432; 58 MoE layers of 256 + 1 shared experts of 2048 and a 256-way router
    attn = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    moe = (256 + 1) * 3 * 7168 * 2048 + 7168 * 256
    total = 2 * 129280 * 7168 + 61 * (attn + 2 * 7168) + 3 * 3 * 7168 * 18432 + 58 * moe + 7168
    assert spec.num_params() == total and abs(total - 671e9) < 1e9  # DeepSeek's 671B (the MTP module aside)
    active = 61 * (attn + 2 * 7168) + 3 * 3 * 7168 * 18432 + 58 * ((8 + 1) * 3 * 7168 * 2048 + 7168 * 256)
    assert spec.active_params_per_token() == active  # 35.7B: DeepSeek's 37B with the embeddings and LM head
    text = _render("--model", "deepseek-v3", "--tp-size", "8", capsys=capsys)
    assert spec.active_params() == total - 58 * (256 - 8) * 3 * 7168 * 2048  # with the embeddings and LM head
    assert "MLA latent 576" in _row(text, "model")
    assert "37.55B active: 8 of 256 experts + 1 shared in 58 MoE layers" in _row(text, "model")
    assert _row(text, "KV bytes/token (model)").endswith("70,272 B")  # bf16 latents: --kv-cache-dtype auto
    assert "weights fp8 (config.json): fp8 128x128 blocks" in _row(text, "engine support")
    # the dense layers in FP8, the routed experts dequantised to bf16 (tests/engine/test_planner_quant.py)
    assert _row(text, "weights per GPU").endswith(f"{spec.weight_bytes(2, 8) / 2**30:.2f} GiB") and \
        spec.weight_bytes(2, 8) < total * 2 // 8 + 3 * 2**30


def test_deepseek_engine_support_covers_its_moe_layers():
    """DeepSeek configs with MoE layers (and all-dense ones) load in the engine, and the planner agrees."""
    from pd_cluster.engine.model.arch import ArchConfig

    cfg = json.loads(BUNDLED["deepseek-v3"].read_text())
    assert unsupported_reason(spec_from_config(cfg, "deepseek-v3")) is None
    arch = ArchConfig.from_dict(cfg)
    assert arch.moe.moe_layers == tuple(range(3, 61)) and arch.moe.routing.e_score_correction_bias
    assert arch.quant.for_module("model.layers.3.mlp.down_proj").block == (128, 128)  # its FP8 release
    assert arch.num_params() == load_spec("deepseek-v3").num_params() + 58 * 256  # + the correction biases
    dense = {**cfg, "first_k_dense_replace": 61}
    assert unsupported_reason(spec_from_config(dense, "dense")) is None
    assert ArchConfig.from_dict(dense).moe is None  # no MoE layer placed: a dense model

