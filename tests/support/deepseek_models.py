"""Tiny random-weight DeepSeek-V2 / V3 checkpoints built with transformers, and transformers' greedy reference.

Both mix a dense first layer (``first_k_dense_replace = 1``) with mixture-of-experts layers of 4 routed experts
(2 per token) and shared experts, so one checkpoint exercises multi-head latent attention and DeepSeek's MoE.
V2: no ``q_lora_rank`` (V2-Lite's direct query), default RoPE, interleaved RoPE rows (always, in V2); softmax
scores with group-limited greedy top-k (2 groups of 2, the best group by its best expert), no renormalisation,
``routed_scaling_factor`` 1.5, two shared experts. V3: ``q_lora_rank``, YaRN with ``mscale`` and
``mscale_all_dim`` (a softmax scale and a cos/sin factor that differ from 1), ``rope_interleave``; sigmoid
scores, a random ``e_score_correction_bias`` (it decides the choice, never the weight), the grouped top-k
(2 groups, the best group by the sum of its best two), renormalised weights times ``routed_scaling_factor``
2.5, one shared expert. Hidden 64, the embedded stories260K tokenizer.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM)

from pd_cluster.engine.assets import DEFAULT_MODEL

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2)

FAMILIES = {
    # name: (HF model class, config class, extra config)
    "deepseek-v2": (DeepseekV2ForCausalLM, DeepseekV2Config, dict(
        num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
        topk_method="group_limited_greedy", n_group=2, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.5, n_shared_experts=2, moe_intermediate_size=32)),
    "deepseek-v3": (DeepseekV3ForCausalLM, DeepseekV3Config, dict(
        num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
        moe_intermediate_size=32, rope_interleave=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})),
}

# Five prompts of the embedded tokenizer's kind, longer than one 16-token page and of different lengths.
PROMPTS = [
    "Once upon a time, there was a little dog named Max who",
    "The sun was shining and the birds were singing in the tall green trees.",
    "Lily and Tom went to the park with their mom. They wanted to",
    "One day, a little bird flew down from the sky and landed on",
    "Sam had a red ball. He liked to throw it high in the air, but one day",
]


def build(family: str, out_dir: Path, seed: int = 0, **overrides):
    """Save a random `family` model (sharded safetensors, real tensor names, the embedded tokenizer) in `out_dir`.

    Weights are drawn with std 1/sqrt(fan_in) and norms near 1 (HF's 0.02 init gives near-ties everywhere);
    V3's ``e_score_correction_bias`` (a buffer, zero at init) gets values of the size of the sigmoid scores'
    spread, so it changes some tokens' experts. `overrides` replace config keys.
    """
    cls, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**{**COMMON, **extra, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(out_dir)
    return model


@functools.lru_cache(maxsize=None)
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def prompt_ids(prompt: str) -> list[int]:
    return tokenizer()(prompt).input_ids


def hf_greedy_recompute(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation by full recompute: every step runs the whole sequence, no cache."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


class LatentDigest:
    """A TP rank extension (`RankServer.install`): a hash of the bytes of some pages of this rank's pool."""

    def __init__(self, shard, tp) -> None:
        self.pool = shard.pool

    def digest(self, pages: list[int]) -> str:
        import hashlib

        return hashlib.sha256(self.pool.read_pages(pages).numpy().tobytes()).hexdigest()


# Linear weights DeepSeek-V3's FP8 release stores block-quantised: attention and MLP projections (experts and
# shared experts too); the router (mlp.gate), norms, embeddings and the LM head stay as they are.
def _is_fp8_weight(name: str) -> bool:
    return ".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def write_block_fp8(src: Path, fp8_dir: Path, dequantized_dir: Path, block: tuple[int, int]) -> int:
    """From the checkpoint in `src`, write the same model in DeepSeek-V3's block-FP8 format to `fp8_dir`
    (``float8_e4m3fn`` weights, ``<name>_scale_inv`` float32 per `block`, ``quantization_config``) and its exact
    dequantised values as an ordinary checkpoint to `dequantized_dir` (transformers' reference). Returns the
    number of weights quantised.

    Each block's scale is its max |w| / 448, so every block uses the FP8 range; the scale tensor sits in the
    shard after its weight's (the index maps it), as a sharded release may place it.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    for out in (fp8_dir, dequantized_dir):
        shutil.copytree(src, out)
    index_path = fp8_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted({f for f in index["weight_map"].values()})
    count = 0
    for i, file in enumerate(files):
        tensors = load_file(str(src / file))
        fp8, deq, scales = {}, {}, {}
        for name, w in tensors.items():
            if not _is_fp8_weight(name):
                fp8[name] = deq[name] = w
                continue
            q, scale_inv = _quantize_blocks(w.float(), block)
            fp8[name] = q
            deq[name] = (q.float() * scale_inv.repeat_interleave(block[0], 0)[:w.shape[0]]
                         .repeat_interleave(block[1], 1)[:, :w.shape[1]]).to(w.dtype)
            scales[name + "_scale_inv"] = scale_inv
            count += 1
        target = files[(i + 1) % len(files)]  # the next shard holds this one's scales
        save_file(fp8, str(fp8_dir / file), metadata={"format": "pt"})
        save_file(deq, str(dequantized_dir / file), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(scales, target))
        extra = fp8_dir / f"scales-{target}"
        save_file(scales, str(extra), metadata={"format": "pt"})
    for file in files:  # merge each shard's incoming scales into it
        extra = fp8_dir / f"scales-{file}"
        merged = {**load_file(str(fp8_dir / file)), **load_file(str(extra))}
        save_file(merged, str(fp8_dir / file), metadata={"format": "pt"})
        extra.unlink()
    index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return count


def _quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32) with ``w ~ q * scale_inv``."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    tiles = padded.view(rows, bn, cols, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).view(rows * bn, cols * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale
