"""Tiny random checkpoints of the families added one file each (`engine/model/families/`), built with
transformers' own classes: each exercises what sets its family apart (see the comments)."""

from __future__ import annotations

from transformers import (CohereConfig, CohereForCausalLM, Exaone4Config, Exaone4ForCausalLM, Gemma3Config,
                          Gemma3ForConditionalGeneration, Glm4Config, Glm4ForCausalLM, Glm4MoeConfig,
                          Glm4MoeForCausalLM, GraniteConfig, GraniteForCausalLM, MinistralConfig,
                          MinistralForCausalLM, Mistral3Config, Mistral3ForConditionalGeneration, Olmo2Config,
                          Olmo2ForCausalLM, PhimoeConfig, PhimoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM,
                          Qwen3NextConfig, Qwen3NextForCausalLM, SmolLM3Config, SmolLM3ForCausalLM, Starcoder2Config,
                          Starcoder2ForCausalLM)

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
            max_position_embeddings=1024)
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
              patch_size=14)


def _gemma3_multimodal(**kw) -> Gemma3Config:
    """Gemma 3's multimodal class over a 6-layer text model (5 sliding layers of 16 tokens to 1 global, linear
    RoPE scaling on the global one)."""
    text = {**TEXT, "num_hidden_layers": 6, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16,
            "query_pre_attn_scalar": 32,
            "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **kw}
    return Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4)


def _mistral3_multimodal(**kw) -> Mistral3Config:
    """Mistral 3's multimodal class over a Mistral text model with a 16-token window and an untied head."""
    text = {**TEXT, "model_type": "mistral", "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 16, **kw}
    return Mistral3Config(text_config=text, vision_config={**VISION, "head_dim": 16}, tie_word_embeddings=False)


NEW_FAMILIES = {
    # name: (HF model class, config class or builder, extra config)
    "gemma3-multimodal": (Gemma3ForConditionalGeneration, _gemma3_multimodal, {}),
    "mistral3-multimodal": (Mistral3ForConditionalGeneration, _mistral3_multimodal, {}),
    # layer_types: sliding, full, sliding
    "ministral": (MinistralForCausalLM, MinistralConfig, dict(
        num_key_value_heads=2, head_dim=8, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # 4 experts of 32 (2 a token, renormalised), a gated shared expert of 48, layer 1 dense; q/k/v biases
    "qwen2-moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, dict(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
    # norms after the blocks only; q and k normed over all heads
    "olmo2": (Olmo2ForCausalLM, Olmo2Config, dict(num_key_value_heads=2, eos_token_id=2, pad_token_id=1)),
    # all four multipliers away from 1; biases on attention and MLP
    "granite": (GraniteForCausalLM, GraniteConfig, dict(
        num_key_value_heads=2, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.25,
        logits_scaling=2.5, attention_bias=True, mlp_bias=True)),
    # sandwich norms under GLM's names, interleaved RoPE on half of each head, q/k/v biases, fused gate/up
    "glm4": (Glm4ForCausalLM, Glm4Config, dict(num_key_value_heads=2, head_dim=16, pad_token_id=0,
                                               eos_token_id=2)),
    # layer 0 dense, then 4 experts (2 a token) in 2 groups (1 kept) with the correction bias, a shared expert,
    # routed scaling 2.5; per-head q/k norms; half-head RoPE
    "glm4-moe": (Glm4MoeForCausalLM, Glm4MoeConfig, dict(
        num_key_value_heads=2, head_dim=16, pad_token_id=0, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        use_qk_norm=True, attention_bias=True)),
    # parallel attention and MLP under one LayerNorm, interleaved RoPE, logits scaled, tied head
    "cohere": (CohereForCausalLM, CohereConfig, dict(num_key_value_heads=2, logit_scale=0.5, attention_bias=True)),
    # NoPE on every 2nd layer
    "smollm3": (SmolLM3ForCausalLM, SmolLM3Config, dict(num_key_value_heads=2, pad_token_id=0,
                                                        no_rope_layer_interval=2)),
    # LayerNorm with bias, a non-gated GeLU MLP, biases everywhere, a 16-token window on every layer
    "starcoder2": (Starcoder2ForCausalLM, Starcoder2Config, dict(num_key_value_heads=2, sliding_window=16)),
    # norms after the blocks only, per-head q/k norms, 3 sliding layers of 16 to 1 global NoPE layer
    "exaone4": (Exaone4ForCausalLM, Exaone4Config, dict(num_key_value_heads=2, num_hidden_layers=4,
                                                        sliding_window=16, sliding_window_pattern=4)),
    # sparsemixer over 4 experts, LayerNorm with bias, attention and LM head biases, longrope with mscales
    "phimoe": (PhimoeForCausalLM, PhimoeConfig, dict(
        num_key_value_heads=2, num_local_experts=4, attention_bias=True, lm_head_bias=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.2, 1.3],
                         "long_factor": [2.0, 3.0, 4.0, 5.0], "short_mscale": 1.2, "long_mscale": 1.5,
                         "original_max_position_embeddings": 512})),
}
MULTIMODAL = ("gemma3-multimodal", "mistral3-multimodal")

# Families whose linear-attention layers keep a recurrent state per request (the pool's state group)
STATE_FAMILIES = {
    # 3 Gated DeltaNet layers (2 key heads, 4 value heads of 8) and 1 gated full-attention layer (4 heads of 16,
    # 2 KV heads, a quarter of each head rotated); 4 experts (2 a token) with a gated shared expert of 48, layer 2
    # dense
    "qwen3-next": (Qwen3NextForCausalLM, Qwen3NextConfig, dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2])),
}
