"""The models of the end-to-end step of the GPU first contact (`first_contact_e2e`): the embedded stories260K and
three tiny random checkpoints written by transformers (its own tensor names and config keys).

- ``stories260K``: the real TinyStories Llama shipped with the engine (`engine.assets.DEFAULT_MODEL`).
- ``tiny-mixtral``: Mixtral, 3 layers, 4 experts of width 32, 2 per token (the fused MoE kernel).
- ``tiny-deepseek-v3``: DeepSeek-V3, 2 layers (the first dense), multi-head latent attention with a
  ``q_lora_rank``, YaRN with ``mscale``/``mscale_all_dim``, 4 routed experts (2 per token, grouped top-k with a
  score-correction bias) and a shared expert (the MLA decode kernel and the fused MoE kernel together).
- ``tiny-gemma3``: Gemma 3 text, 6 layers, 5 sliding (window 16) to 1 global with linear RoPE scaling, q/k norms,
  a final logit softcap (KV cache groups with CUDA graphs).

Hidden 64, vocabulary 512 with the embedded tokenizer, so text prompts work through the OpenAI API. Weights are
drawn with std 1/sqrt(fan_in) and norms near 1, so that greedy argmaxes are not near ties (transformers' 0.02
init gives near-uniform logits). `hf_greedy` is transformers' own greedy continuation by full recompute, the
reference the engine's torch path is compared with.
"""

from __future__ import annotations

from pathlib import Path

TINY = ("tiny-mixtral", "tiny-deepseek-v3", "tiny-gemma3")
_BASE = dict(vocab_size=512, hidden_size=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


def _config(name: str):
    import transformers as tf

    if name == "tiny-mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            **_BASE, intermediate_size=32, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2)
    if name == "tiny-deepseek-v3":
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **_BASE, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1, moe_intermediate_size=32,
            rope_interleave=True, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 256, "mscale": 1.0,
                                                "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})
    if name == "tiny-gemma3":
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **_BASE, intermediate_size=128, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
            head_dim=16, sliding_window=16, query_pre_attn_scalar=32, final_logit_softcapping=20.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0})
    raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY)}")


def build(name: str, folder: Path, seed: int = 0):
    """Write tiny model `name` (safetensors, config, the embedded tokenizer) into `folder`; returns the
    transformers model (float32, eval)."""
    import torch
    from transformers import AutoTokenizer

    from pd_cluster.engine.assets import DEFAULT_MODEL

    cls, cfg = _config(name)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek-V3: a bias that changes some choices
                b.normal_(0.0, 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL).save_pretrained(folder)
    return model


def hf_greedy(model, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: the argmax of a fresh full forward pass per token."""
    import torch

    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = list(ids)
            for _ in range(max_new):
                logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
                seq.append(int(logits.argmax()))
            out.append(seq[len(ids):])
    return out
