"""Quantised experts under tensor parallelism on CPU (2 OS processes over gloo): gpt-oss's MXFP4 experts and
DeepSeek-V3's and Qwen3-MoE's FP8-block experts (`quant_models`), split by width in whole blocks (each rank reads its gate/up
rows and its down columns of codes and scales; MXFP4 experts of 3 blocks split 2 + 1, the second rank's tail
zero-padded) or, with ``enable_expert_parallel``, held whole per rank. Greedy
tokens equal transformers' on the dequantised twin, and rank 0 holds its share quantised."""

from __future__ import annotations

import pytest
import torch
from quant_models import deepseek_fp8, gpt_oss_mxfp4, qwen3_moe_fp8

from pd_cluster.engine import LLM, SamplingParams

# rank 0's w13_weight: TP holds all 4 experts with half of the 64-wide width (2 x 32 rows), EP 2 experts whole;
# 96-wide MXFP4 experts are 3 blocks: 2 on rank 0 (2 x 64 rows), 1 and a zero-padded one on rank 1
SHAPES = {("gpt-oss", False): ((4, 64, 32), torch.uint8), ("gpt-oss", True): ((2, 128, 32), torch.uint8),
          ("gpt-oss-96", False): ((4, 128, 32), torch.uint8),
          ("deepseek-v3", False): ((4, 64, 64), torch.float8_e4m3fn),
          ("deepseek-v3", True): ((2, 128, 64), torch.float8_e4m3fn),
          ("qwen3-moe", False): ((4, 64, 64), torch.float8_e4m3fn)}
BUILD = {"gpt-oss": gpt_oss_mxfp4, "gpt-oss-96": lambda root: gpt_oss_mxfp4(root, intermediate_size=96),
         # v_head_dim 32: o_proj's 4 x 32 input columns split in whole blocks (its dense layers stay FP8 too)
         "deepseek-v3": lambda root: deepseek_fp8(root, v_head_dim=32),
         # 4 KV heads of 16: k_proj/v_proj split in whole 32-row blocks
         "qwen3-moe": lambda root: qwen3_moe_fp8(root, num_key_value_heads=4)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, expert_parallel", list(SHAPES))
def test_tp2_quantised_experts_equal_transformers_on_the_twin(family, expert_parallel, tmp_path):
    path, _, prompts, hf_greedy = BUILD[family](tmp_path)
    llm = LLM(str(path), tp_size=2, kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7,
              enable_expert_parallel=expert_parallel)
    try:
        layer = 1 if family == "deepseek-v3" else 0  # DeepSeek's layer 0 is dense
        w13 = llm.engine.loaded.model.layers[layer].mlp.experts.w13_weight
        assert (tuple(w13.shape), w13.dtype) == SHAPES[(family, expert_parallel)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        for ids, out in zip(prompts, outs):
            assert list(out.token_ids) == hf_greedy(ids), (family, expert_parallel, len(ids))
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    finally:
        llm.engine.close()
