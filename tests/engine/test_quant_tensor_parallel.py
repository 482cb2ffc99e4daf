"""Quantised checkpoints under tensor parallelism on CPU (two gloo ranks): each rank holds its slice of the
quantised weights and their scales (FP8 blocks cut on block edges; int4 output rows on packed words, input
columns on groups, or with act order every group's scales and its slice of g_idx), and the greedy tokens equal
transformers' on the dequantised twin. A TP size that would cut a block is refused before any rank starts."""

from __future__ import annotations

import pytest
from quant_checkpoints import FORMATS, write_quantized
from random_models import build, hf_greedy_full, prompt_ids
from transformers import AutoModelForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.quant.linear import QuantLinear

LLAMA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# every format as released: FP8 blocks (fp8, compressed-tensors), FP8 per tensor with a static activation scale, FP8
# rows (compressed-tensors per channel, fbgemm), int4 with act order (GPTQ, compressed-tensors W4A16) and int4 groups
# with zero points in AWQ's packing
TP_FORMATS = list(FORMATS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-tp")
    build("llama3-rope-scaling", root / "src", **LLAMA)
    for fmt in TP_FORMATS:
        write_quantized(root / "src", root / fmt, root / f"{fmt}-twin", fmt)
    return root


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fmt", TP_FORMATS)
def test_tp2_greedy_equals_transformers_on_the_twin(fmt, checkpoints):
    prompts = prompt_ids(5)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints / f"{fmt}-twin").eval()
    expected = [hf_greedy_full(hf, ids, 24) for ids in prompts]
    llm = LLM(str(checkpoints / fmt), tp_size=2, kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7)
    try:
        layer = llm.engine.loaded.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.out_features == 64
        assert layer.mlp.down_proj.in_features == 64  # rank 0's half of the 128 input columns
        assert [list(o.token_ids) for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.engine.close()


def test_a_tp_size_that_cuts_an_fp8_block_is_refused_before_any_rank_starts():
    """The MLP's 192 columns at TP 4 are 48 per rank: whole heads and widths, but 1.5 blocks of 32 columns."""
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 32]}}
    arch = ArchConfig.from_dict(cfg)
    arch.check_tp(2)
    with pytest.raises(ValueError, match=r"--tp-size 4 splits model\.layers\.0\.mlp\.down_proj's 16x32 FP8 blocks "
                                         r"\(input columns\): 192 / 4 = 48 per rank is not a multiple of 32"):
        arch.check_tp(4)  # what check_tp_size runs on the checkpoint's config before starting the ranks


def test_a_layer_held_dequantised_may_cut_blocks():
    """A tiny DeepSeek-V3 in 32 x 32 FP8 blocks at TP 2: MLA's kv_b_proj (4 heads x (8 + 32) = 160 rows, 80 a rank)
    is dequantised whole before it is sliced, so it does not refuse the split; the FP8 layers it keeps split in
    whole blocks (q_b_proj's 4 x (8 + 8) rows, o_proj's 4 x 32 input columns, the 64-wide experts and shared
    expert)."""
    from deepseek_models import COMMON, FAMILIES

    cfg = {**COMMON, **FAMILIES["deepseek-v3"][2], "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 32,
           "moe_intermediate_size": 64,
           "architectures": ["DeepseekV3ForCausalLM"],
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    ArchConfig.from_dict(cfg).check_tp(2)
    with pytest.raises(ValueError, match=r"--tp-size 2 splits model\.layers\.0\.self_attn\.o_proj's 32x32 FP8 blocks "
                                         r"\(input columns\): 96 / 2 = 48 per rank is not a multiple of 32"):
        ArchConfig.from_dict({**cfg, "v_head_dim": 24}).check_tp(2)
