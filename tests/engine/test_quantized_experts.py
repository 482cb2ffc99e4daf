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
from quant_models import FP8_BLOCK, deepseek_fp8, expert_tensor_bytes, gpt_oss_mxfp4, same_weights
from transformers import GptOssForCausalLM, Mxfp4Config, Qwen3MoeForCausalLM

from pd_cluster.engine import LLM, SamplingParams
from pd_cluster.engine.model import families
from pd_cluster.engine.model.moe_config import MoEConfig, RoutingConfig, check_moe_parallel
from pd_cluster.engine.quant.expert_format import ExpertQuant, expert_quant_of

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
DEEPSEEK = families.get("DeepseekV3ForCausalLM")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(MXFP4 folder, twin, prompts, transformers' greedy on the twin)."""
    return gpt_oss_mxfp4(tmp_path_factory.mktemp("gptoss"))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return deepseek_fp8(tmp_path_factory.mktemp("dsv3"))


def _generate(path, prompts, **kw):
    llm = LLM(str(path), kv_cache_dtype="fp32", page_size=16, **kw)
    try:
        outs = [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]
        return outs, llm.engine.loaded
    finally:
        llm.engine.close()


def _check_quantised(path, twin, prompts, hf_greedy, held_dtype):
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
    _check_quantised(*gpt_oss, torch.uint8)


def test_transformers_reads_the_mxfp4_folder_into_the_twin(gpt_oss):
    """The test checkpoint is in the release layout: transformers' own MXFP4 reader gives the twin's weights."""
    path, twin = gpt_oss[:2]
    quantised = GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32)
    assert same_weights(quantised, GptOssForCausalLM.from_pretrained(twin))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"


def test_deepseek_v3_fp8_blocks_equal_their_twin_and_transformers(deepseek):
    _check_quantised(*deepseek, torch.float8_e4m3fn)


def test_qwen3_moe_fp8_blocks_equal_their_twin_and_transformers(tmp_path):
    random_models.build("qwen3-moe", tmp_path / "src")
    deepseek_models.write_block_fp8(tmp_path / "src", tmp_path / "q", tmp_path / "twin", FP8_BLOCK)
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "twin").eval()
    _check_quantised(tmp_path / "q", tmp_path / "twin", random_models.prompt_ids(3),
                     lambda ids: random_models.hf_greedy_full(hf, ids, 24), torch.float8_e4m3fn)


def test_dummy_weights_for_quantised_experts(gpt_oss):
    """``--load-format dummy`` fills the codes and scales too (finite logits, every expert's codes drawn)."""
    outs, loaded = _generate(gpt_oss[0], [[1, 2, 3, 4]], load_format="dummy")
    assert len(outs[0]) == 24
    experts = loaded.model.layers[0].mlp.experts
    assert experts.w13_weight.float().std() > 50 and 118 <= int(experts.w13_weight_scale.float().mean()) <= 120


def test_tp_splits_keep_whole_blocks():
    """FP8: a TP size whose split cuts a block is refused by name (vLLM refuses it too). MXFP4: each rank takes
    whole blocks of 32, the tail zero-padded (vLLM's split): gpt-oss-120b's 2880 (90 blocks) is 384 a rank at TP 8."""
    fp8 = MoEConfig(8, 768, RoutingConfig(8, 2), (0,), weight_quant=ExpertQuant("fp8_block", (128, 128)))
    check_moe_parallel(fp8, 2, expert_parallel=False)  # 384: three blocks
    with pytest.raises(ValueError, match=r"--tp-size 4 splits each expert's intermediate size 768 into 192, which "
                                         r"cuts the experts' weight blocks \(fp8 blocks of 128x128: 192 rows .*"
                                         r"--enable-expert-parallel"):
        check_moe_parallel(fp8, 4, expert_parallel=False)  # Qwen3-30B-A3B-FP8 at TP 4
    check_moe_parallel(fp8, 4, expert_parallel=True)  # whole experts per rank
    mx = ExpertQuant.mxfp4()
    check_moe_parallel(MoEConfig(128, 2880, RoutingConfig(128, 4), (0,), weight_quant=mx), 8, expert_parallel=False)
    assert (mx.rank_width(2880, 8), mx.rank_width(2880, 2), mx.rank_width(96, 2)) == (384, 1440, 64)


def test_each_expert_format_is_read_from_the_config():
    """Per-tensor and per-channel FP8 and int4 experts are kept in those formats; FP8 with dynamic per-token-group
    activations but no blocks is refused by name."""
    per_tensor = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    rows = expert_quant_of(per_tensor, [DEEPSEEK.expert_checkpoint_module(i) for i in (0, 1)])
    assert (rows.format, rows.name, rows.scheme.activations) == ("fp8_rows", "fp8 per tensor", "token")
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}}
    int4 = expert_quant_of(gptq, [DEEPSEEK.expert_checkpoint_module(1)])
    assert (int4.format, int4.name, int4.group) == ("int4", "int4 groups of 128", 128)
    assert int4.nbytes(8, 256, 1024) == 8 * 128 * 256 * 4 + 8 * 8 * 256 * 2  # words + fp16 scales (symmetric)
    with pytest.raises(ValueError, match=r"--tp-size 4 splits .* 192, which cuts .*int4 groups of 128"):
        int4.check_split(768, 4)
    ds = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert expert_quant_of(ds, [DEEPSEEK.expert_checkpoint_module(3)]) == ExpertQuant("fp8_block", (128, 128))
    ignored = {"quantization_config": {**ds["quantization_config"], "modules_to_not_convert": ["mlp.experts"]}}
    assert expert_quant_of(ignored, [DEEPSEEK.expert_checkpoint_module(3)]) is None
    mx = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    assert expert_quant_of(mx, ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]) == ExpertQuant.mxfp4()


def test_each_family_names_its_experts_checkpoint_module():
    """What the quantisation config is matched against: expert 0's first projection or the stacked module, in
    the checkpoint's own names (renames undone)."""
    assert DEEPSEEK.expert_checkpoint_module(3) == "model.layers.3.mlp.experts.0.gate_proj"
    assert families.get("MixtralForCausalLM").expert_checkpoint_module(2) == "model.layers.2.block_sparse_moe.experts.0.w1"
    assert families.get("GptOssForCausalLM").expert_checkpoint_module(0) == "model.layers.0.mlp.experts"
    assert families.get("Llama4ForCausalLM").expert_checkpoint_module(1) == "model.layers.1.feed_forward.experts"


def test_unquantised_expert_tensors_under_a_quantised_config_are_refused(gpt_oss, tmp_path):
    """The twin's float experts with the MXFP4 config: never cast into codes."""
    twin = gpt_oss[1]
    for f in twin.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    cfg = json.loads((twin / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj holds the routed "
                                         r"experts unquantised, but .* mxfp4"):
        _generate(tmp_path, [[1, 2, 3]])
