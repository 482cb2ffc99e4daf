"""Quantised experts under tensor parallelism on CPU (2 OS processes over gloo): gpt-oss's MXFP4 experts and
DeepSeek-V3's FP8-block experts (the checkpoints of `test_quantized_experts`), split by width in whole blocks
(each rank reads its gate/up rows and its down columns of codes and scales) or, with ``enable_expert_parallel``,
held whole per rank. Greedy tokens equal transformers' on the dequantised twin, and rank 0 holds its share
quantised."""

from __future__ import annotations

import pytest
import torch
import deepseek_models
import random_models
from test_quantized_experts import BLOCK, GREEDY, _folders
from quant_models import write_mxfp4
from transformers import DeepseekV3ForCausalLM, GptOssForCausalLM

from pd_cluster.engine import LLM


def _gpt_oss(root):
    path, twin = _folders(root, lambda d: random_models.build("gpt-oss", d, intermediate_size=64), write_mxfp4)
    hf = GptOssForCausalLM.from_pretrained(twin).eval()
    return path, random_models.long_prompt_ids(3), lambda ids: random_models.hf_greedy_full(hf, ids, 24)


def _deepseek(root):
    path, twin = _folders(root, lambda d: deepseek_models.build("deepseek-v3", d, moe_intermediate_size=64),
                          lambda s, q, t: deepseek_models.write_block_fp8(s, q, t, BLOCK))
    hf = DeepseekV3ForCausalLM.from_pretrained(twin).eval()
    prompts = [deepseek_models.prompt_ids(p) for p in deepseek_models.PROMPTS[:3]]
    return path, prompts, lambda ids: deepseek_models.hf_greedy_recompute(hf, ids, 24)


# rank 0's w13_weight: TP holds all 4 experts with half of the 64-wide width (2 x 32 rows), EP 2 experts whole
SHAPES = {("gpt-oss", False): ((4, 64, 32), torch.uint8), ("gpt-oss", True): ((2, 128, 32), torch.uint8),
          ("deepseek-v3", False): ((4, 64, 64), torch.float8_e4m3fn),
          ("deepseek-v3", True): ((2, 128, 64), torch.float8_e4m3fn)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, expert_parallel", list(SHAPES))
def test_tp2_quantised_experts_equal_transformers_on_the_twin(family, expert_parallel, tmp_path):
    path, prompts, hf_greedy = (_gpt_oss if family == "gpt-oss" else _deepseek)(tmp_path)
    llm = LLM(str(path), tp_size=2, kv_cache_dtype="fp32", page_size=16, chunked_prefill_size=7,
              enable_expert_parallel=expert_parallel)
    try:
        layer = 0 if family == "gpt-oss" else 1  # DeepSeek's layer 0 is dense
        w13 = llm.engine.loaded.model.layers[layer].mlp.experts.w13_weight
        assert (tuple(w13.shape), w13.dtype) == SHAPES[(family, expert_parallel)]
        outs = llm.generate(prompts, GREEDY)
        for ids, out in zip(prompts, outs):
            assert list(out.token_ids) == hf_greedy(ids), (family, expert_parallel, len(ids))
        assert llm.engine.num_free_pages() == llm.engine.allocator.num_pages
    finally:
        llm.engine.close()
