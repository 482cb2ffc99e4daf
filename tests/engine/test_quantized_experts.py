"""Routed experts kept quantised as released: gpt-oss's MXFP4 and DeepSeek-V3's / Qwen3-MoE's FP8 blocks.

Each tiny checkpoint is a transformers-built model whose random weights were quantised into the release format
(`quant_models`): gpt-oss with MXFP4 experts (``*_blocks``/``*_scales``, the release's ``quantization_config``),
DeepSeek-V3 and Qwen3-MoE with every attention, dense and expert projection in 32 x 32 FP8 blocks. The engine
(torch path, TP 1) gives exactly the greedy tokens it gives on the dequantised twin, and transformers' on the twin;
its experts stay quantised (the resident bytes it reports are the checkpoint's expert bytes), and transformers
itself reads the MXFP4 folder into the twin's weights. TP 2 and expert parallelism: `test_quantized_experts_tp`.
"""

from __future__ import annotations

import json

import pytest
import torch
import deepseek_models
import random_models
from quant_models import expert_tensor_bytes, same_weights, write_mxfp4
from transformers import DeepseekV3ForCausalLM, GptOssForCausalLM, Mxfp4Config, Qwen3MoeForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig, check_moe_parallel
from pd_cluster.engine.quant.expert_format import ExpertQuant, expert_quant_of

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BLOCK = (32, 32)


def _folders(root, build, write):
    build(root / "src")
    write(root / "src", root / "q", root / "twin")
    return root / "q", root / "twin"


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(MXFP4 folder, twin folder): experts 64 wide, so that TP 2 keeps whole blocks of 32."""
    return _folders(tmp_path_factory.mktemp("gptoss"), lambda d: random_models.build("gpt-oss", d, intermediate_size=64),
                    write_mxfp4)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return _folders(tmp_path_factory.mktemp("dsv3"),
                    lambda d: deepseek_models.build("deepseek-v3", d, moe_intermediate_size=64),
                    lambda s, q, t: deepseek_models.write_block_fp8(s, q, t, BLOCK))


def _generate(path, prompts, **kw):
    llm = LLM(str(path), kv_cache_dtype="fp32", page_size=16, **kw)
    try:
        outs = [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]
        return outs, llm.engine.loaded
    finally:
        llm.engine.close()


def _check_quantised(path, twin, hf_greedy, prompts, held_dtype):
    got, loaded = _generate(path, prompts)
    want, twin_loaded = _generate(twin, prompts)
    assert got == want
    assert got == [hf_greedy(ids) for ids in prompts]
    experts = [m for m in loaded.model.modules() if type(m).__name__ == "FusedExperts"]
    assert experts and all(m.w13_weight.dtype == held_dtype for m in experts)
    ckpt = expert_tensor_bytes(path)
    assert abs(loaded.expert_nbytes - ckpt) <= 0.1 * ckpt, (loaded.expert_nbytes, ckpt)
    assert loaded.expert_nbytes * 3 < twin_loaded.expert_nbytes  # the twin's float32 experts
    assert loaded.weights_nbytes < twin_loaded.weights_nbytes


def test_gpt_oss_mxfp4_equals_its_twin_and_transformers(gpt_oss):
    path, twin = gpt_oss
    hf = GptOssForCausalLM.from_pretrained(twin).eval()
    prompts = random_models.long_prompt_ids(3)
    _check_quantised(path, twin, lambda ids: random_models.hf_greedy_full(hf, ids, 24), prompts, torch.uint8)


def test_transformers_reads_the_mxfp4_folder_into_the_twin(gpt_oss):
    """The test checkpoint is in the release layout: transformers' own MXFP4 reader gives the twin's weights."""
    path, twin = gpt_oss
    quantised = GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32)
    assert same_weights(quantised, GptOssForCausalLM.from_pretrained(twin))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"


def test_deepseek_v3_fp8_blocks_equal_their_twin_and_transformers(deepseek):
    path, twin = deepseek
    hf = DeepseekV3ForCausalLM.from_pretrained(twin).eval()
    prompts = [deepseek_models.prompt_ids(p) for p in deepseek_models.PROMPTS[:3]]
    _check_quantised(path, twin, lambda ids: deepseek_models.hf_greedy_recompute(hf, ids, 24), prompts,
                     torch.float8_e4m3fn)


def test_qwen3_moe_fp8_blocks_equal_their_twin_and_transformers(tmp_path):
    path, twin = _folders(tmp_path, lambda d: random_models.build("qwen3-moe", d),
                          lambda s, q, t: deepseek_models.write_block_fp8(s, q, t, BLOCK))
    hf = Qwen3MoeForCausalLM.from_pretrained(twin).eval()
    prompts = random_models.prompt_ids(3)
    _check_quantised(path, twin, lambda ids: random_models.hf_greedy_full(hf, ids, 24), prompts,
                     torch.float8_e4m3fn)


def test_dummy_weights_for_quantised_experts(gpt_oss):
    """``--load-format dummy`` fills the codes and scales too (finite logits, every expert's codes drawn)."""
    outs, loaded = _generate(gpt_oss[0], [[1, 2, 3, 4]], load_format="dummy")
    assert len(outs[0]) == 24
    experts = loaded.model.layers[0].mlp.experts
    assert experts.w13_weight.float().std() > 50 and 118 <= int(experts.w13_weight_scale.float().mean()) <= 120


def test_a_tp_split_that_cuts_a_block_is_refused_by_name():
    mx = MoEConfig(4, 32, RoutingConfig(4, 2), (0,), weight_quant=ExpertQuant.mxfp4())
    with pytest.raises(ValueError, match=r"--tp-size 2 splits each expert's intermediate size 32 into 16, which "
                                         r"cuts the experts' weight blocks \(mxfp4: 16 columns is not a multiple of "
                                         r"32\).*--enable-expert-parallel"):
        check_moe_parallel(mx, 2, expert_parallel=False)
    check_moe_parallel(mx, 2, expert_parallel=True)  # whole experts per rank
    fp8 = MoEConfig(8, 768, RoutingConfig(8, 2), (0,), weight_quant=ExpertQuant("fp8_block", (128, 128)))
    check_moe_parallel(fp8, 2, expert_parallel=False)  # 384: three blocks
    with pytest.raises(ValueError, match=r"into 192, which cuts the experts' weight blocks \(fp8 blocks of "
                                         r"128x128: 192 rows"):
        check_moe_parallel(fp8, 4, expert_parallel=False)  # Qwen3-30B-A3B-FP8 at TP 4, as vLLM refuses it


def test_formats_the_kernel_does_not_compute_are_refused():
    per_tensor = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    with pytest.raises(ValueError, match=r"routed experts in fp8 per tensor.*not computed by the fused MoE kernel"):
        expert_quant_of(per_tensor, "Qwen3MoeForCausalLM", (0, 1))
    ds = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert expert_quant_of(ds, "DeepseekV3ForCausalLM", (3,)) == ExpertQuant("fp8_block", (128, 128))
    ignored = {"quantization_config": {**ds["quantization_config"], "modules_to_not_convert": ["mlp.experts"]}}
    assert expert_quant_of(ignored, "DeepseekV3ForCausalLM", (3,)) is None


def test_unquantised_expert_tensors_under_a_quantised_config_are_refused(gpt_oss, tmp_path):
    """The twin's float experts with the MXFP4 config: never cast into codes."""
    _, twin = gpt_oss
    for f in twin.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    cfg = json.loads((twin / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj holds the routed "
                                         r"experts unquantised, but .* mxfp4"):
        _generate(tmp_path, [[1, 2, 3]])
