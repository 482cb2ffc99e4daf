"""Tiny random-weight HF checkpoints of each supported family, built with transformers."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch
from transformers import (AutoTokenizer, DynamicCache, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, Llama4Config, Llama4ForCausalLM,
                          Llama4ForConditionalGeneration, Llama4TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from family_models import MULTIMODAL, NEW_FAMILIES, STATE_FAMILIES

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.loader import load_model
from pd_cluster.engine.model.rope import longrope_threshold

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
              max_position_embeddings=1024)

FAMILIES = {
    # name: (HF model class, config class, extra config)
    "llama-gqa4": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2)),
    "qwen2-bias-tied": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": (Qwen3ForCausalLM, Qwen3Config, dict(num_key_value_heads=4, head_dim=16)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    "mistral-window": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=16)),
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128})),
    "qwen2-yarn": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
    "llama-linear-rope": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=4, rope_scaling={
        "rope_type": "linear", "factor": 2.0})),
    # mixture of experts: 4 experts of width 32, 2 per token
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(num_key_value_heads=2, intermediate_size=32,
                                                        num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1])),  # layer 1 is a dense MLP of intermediate_size
    "qwen3-moe-sparse-step": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        num_key_value_heads=4, head_dim=16, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=False, decoder_sparse_step=2)),  # MoE on layer 1 only; weights not renormalised
    "phi3": (Phi3ForCausalLM, Phi3Config, dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                               eos_token_id=2)),
    # longrope with its attention factor (max_position_embeddings / original = 16): sequences past 64 tokens use
    # the long factors (the engine's default context length, 1024, is past 64 too)
    "phi3-longrope-partial": (Phi3ForCausalLM, Phi3Config, dict(
        num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3], "long_factor": [3.0, 7.0]})),
    # Phi-4-mini's shape: GQA (4 heads, 2 KV), 16-wide heads of which 0.75 rotate, tied embeddings, longrope from
    # 64 tokens (its attention factor from max_position_embeddings / 64)
    "phi4-mini-longrope": (Phi3ForCausalLM, Phi3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
        original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5], "long_factor": [2.0, 3.0, 5.0, 8.0, 9.0, 12.0]})),
}
MOE_FAMILIES = ("mixtral", "qwen3-moe", "qwen3-moe-sparse-step")


def _llama4_text(**kw) -> dict:
    """A tiny Llama 4 text config: chunked RoPE layers (chunk 16) and NoPE global ones (every 2nd), MoE on every
    2nd layer (4 experts of width 32, a shared expert, top-1), dense MLPs 128 wide; floor_scale 8 so that the
    NoPE layers' temperature tuning changes the queries within a short prompt."""
    return dict(num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
                num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16,
                no_rope_layer_interval=2, floor_scale=8, attn_scale=0.1, **kw)


def _llama4_multimodal(**kw) -> Llama4Config:
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
    return Llama4Config(text_config={**COMMON, "num_hidden_layers": 4, **_llama4_text(), **kw}, vision_config=vision)


# Hybrid attention: every layer type appears; windows and chunks of 16 tokens, prompts of 40 to 80 (`long_prompt_ids`)
HYBRID_FAMILIES = {
    # Gemma 2: sliding / full alternating, softcapping (attention 50, final 30), GeGLU, (1 + w) norms
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, dict(num_key_value_heads=2, head_dim=16, sliding_window=16,
                                                     query_pre_attn_scalar=32, num_hidden_layers=4)),
    # Gemma 3: 5 local (base 10,000) to 1 global (base 1e6, linear RoPE scaling x2), q/k norms
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(num_key_value_heads=2, head_dim=16, sliding_window=16,
                                                         query_pre_attn_scalar=32, num_hidden_layers=6,
                                                         final_logit_softcapping=20.0,
                                                         rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # gpt-oss: sliding / full alternating, sinks, biases, 4 experts (2 per token) with the clamped SwiGLU, YaRN
    "gpt-oss": (GptOssForCausalLM, GptOssConfig, dict(
        num_key_value_heads=2, head_dim=16, sliding_window=16, num_hidden_layers=4, intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 256, "rope_theta": 150000.0})),
    "llama4": (Llama4ForCausalLM, Llama4TextConfig, dict(num_hidden_layers=4, **_llama4_text())),
    "llama4-multimodal": (Llama4ForConditionalGeneration, _llama4_multimodal, {}),
    # Qwen2 with windows from layer max_window_layers on (layer_types dropped from config.json, as on the Hub)
    "qwen2-window-layers": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2, use_sliding_window=True,
                                                                 sliding_window=16, max_window_layers=1)),
    "mistral-window16": (MistralForCausalLM, MistralConfig, dict(num_key_value_heads=2, sliding_window=16)),
}
FAMILIES.update(HYBRID_FAMILIES)
FAMILIES.update(NEW_FAMILIES)
FAMILIES.update(STATE_FAMILIES)
DROP_KEYS = {"qwen2-window-layers": ("layer_types",)}  # config.json keys removed after save_pretrained


def hf_config(family: str, **overrides):
    """The transformers config of `family` (`overrides` replace its keys; a multimodal one's text keys)."""
    _, cfg_cls, extra = FAMILIES[family]
    if family == "llama4-multimodal" or family in MULTIMODAL:
        return cfg_cls(**overrides)
    return cfg_cls(**{**COMMON, **extra, **overrides})


def build(family: str, out_dir: Path, seed: int = 0, **overrides):
    """Save a random model of `family` (sharded safetensors + the embedded tokenizer) into `out_dir`;
    `overrides` replace config keys.

    Weights are drawn with std 1/sqrt(fan_in) and norms near 1, so logits are far
    from uniform (HF's default 0.02 init gives near-ties everywhere).
    """
    torch.manual_seed(seed)
    model = FAMILIES[family][0](hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):  # gpt-oss: sink logits of the scores' size, so that they matter
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    model.save_pretrained(out_dir, max_shard_size="200KB")  # several shards + model.safetensors.index.json
    embedded_tokenizer().save_pretrained(out_dir)
    if family in DROP_KEYS:
        path = Path(out_dir) / "config.json"
        cfg = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in cfg.items() if k not in DROP_KEYS[family]}))
    return model


def prompt_ids(n: int = 5) -> list[list[int]]:
    """The first `n` TinyStories prompts of `engine_reference.PROMPTS` as the embedded tokenizer's ids."""
    from engine_reference import PROMPTS

    tok = embedded_tokenizer()
    return [tok(p).input_ids for p in PROMPTS[:n]]


@functools.lru_cache(maxsize=1)
def embedded_tokenizer():
    """The embedded model's tokenizer, loaded once per test session (read only: saved and called)."""
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def long_prompt_ids(n: int = 5, lengths: tuple[int, ...] = (40, 53, 64, 71, 80)) -> list[list[int]]:
    """`n` prompts of the given lengths (tokens; longer than 16-token windows and chunks), each its
    TinyStories prompt repeated: `prompt_ids` cycled to length."""
    out = []
    for i, ids in enumerate(prompt_ids(n)):
        want = lengths[i % len(lengths)]
        out.append((ids * (want // len(ids) + 1))[:want])
    return out


def hf_greedy_full(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation by full recompute: every token is the argmax of the last position of a
    fresh forward pass over the whole sequence (no KV cache)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = hf_logits(model, seq)[-1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy_full` of every prompt, computed together: each step is one forward pass over the sequences
    right-padded to the longest one, and each sequence's next token is the argmax at its own last position.
    Causal attention never lets a position see the padding after it, so every token is the one
    `hf_greedy_full` gives (the passes are batched, nothing else changes). Models whose RoPE frequencies depend
    on the sequence length (``longrope``, ``dynamic``: the padded length would choose them) run one prompt at a
    time."""
    if _rope_reads_the_length(model.config):
        return [hf_greedy_full(model, ids, max_new_tokens) for ids in prompts]
    seqs = [list(ids) for ids in prompts]
    if isinstance(model, Llama4ForConditionalGeneration):
        model = model.language_model
    with torch.no_grad():
        for _ in range(max_new_tokens):
            width = max(map(len, seqs))
            logits = model(torch.tensor([s + [0] * (width - len(s)) for s in seqs]), use_cache=False).logits
            for row, seq in enumerate(seqs):
                seq.append(int(logits[row, len(seq) - 1].argmax()))
    return [seq[len(ids):] for seq, ids in zip(seqs, prompts)]


def _rope_reads_the_length(config) -> bool:
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kinds = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # one per layer type (Gemma 3), or one
    return any(r.get("rope_type", r.get("type")) in ("longrope", "dynamic") for r in kinds)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] of one forward pass without a cache. For text input
    Llama4ForConditionalGeneration's forward is its ``language_model`` over its own embeddings; that is called
    directly, since the outer forward's output reads a field the text-only path lacks (``image_outputs``,
    transformers 5.24)."""
    x = torch.tensor([ids])
    if isinstance(model, Llama4ForConditionalGeneration):
        model = model.language_model
    return model(x, use_cache=False).logits[0]


def engine_logits(path: Path, ids: list[int], kv_cache_dtype: str = "fp32", page_size: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] of one prefill through the engine's model, pool and reference attention (longrope:
    the factor set of a request of `ids`, `Request.rope_variant`)."""
    lm = load_model(str(path))
    a = lm.arch
    layout = KVLayout(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, page_size, kv_cache_dtype,
                      tuple(lm.k_scales), tuple(lm.v_scales))
    pool = KVPool(layout, 64, "cpu", torch.float32)
    backend = TorchAttentionBackend(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.softmax_scale,
                                    layers=a.layer_attention)
    pages = list(range(1, -(-len(ids) // page_size) + 1))
    batch = build_forward_batch([np.array(ids)], [0], [pages], [np.arange(len(ids))], 0, page_size,
                                torch.device("cpu"))
    long_from = longrope_threshold(a.layer_attention)
    if long_from is not None and len(ids) > long_from:
        batch.rope_variant = torch.ones(len(ids), dtype=torch.long)
    return lm.model(batch, pool, backend)


class RelativeNoiseCache(DynamicCache):
    """Stores K and V multiplied by (1 + U(-u, u)): random relative errors of at most `u`."""

    def __init__(self, u: float, seed: int, **kwargs):
        super().__init__(**kwargs)
        self.u = u
        self.gen = torch.Generator().manual_seed(seed)

    def _noise(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + self.u * (2 * torch.rand(x.shape, generator=self.gen) - 1))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self._noise(key_states), self._noise(value_states), layer_idx, *args, **kwargs)


def row_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over positions of ||out - ref|| / ||ref|| (per-position logit vectors)."""
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()


def build_with_end_of_turn(out_dir: Path, max_new_tokens: int = 24, first: int = 4,
                           **generation) -> tuple[object, list[int], list[int], int]:
    """A tiny random Llama (`build` ``llama-gqa4``) whose ``generation_config.json`` adds to ``eos_token_id`` an
    end-of-turn id that greedy decoding of the first `prompt_ids` prompt reaches: the first token of transformers' greedy continuation,
    from index `first` on, that it has not generated before (so the stop cannot come earlier, and the test cannot
    pass by stopping at once). `generation` adds keys to the file (``temperature=0.6``, ...).

    Returns:
        (the transformers model, the prompt's ids, their greedy continuation of `max_new_tokens` tokens with no
        stop, the id added).
    """
    from transformers import GenerationConfig

    prompt = prompt_ids(1)[0]
    model = build("llama-gqa4", out_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    greedy = out[0, len(prompt):].tolist()
    eot = next(t for i, t in enumerate(greedy) if i >= first and t not in greedy[:i] and t > 2)
    path = Path(out_dir) / "generation_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(eos_token_id=[cfg["eos_token_id"], eot], **generation)
    path.write_text(json.dumps(cfg, indent=2))
    model.generation_config = GenerationConfig.from_pretrained(out_dir)
    return model, prompt, greedy, eot


def hf_stop(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate()`` greedy continuation of `prompt`, stopped by the model's own generation config
    (its ``eos_token_id`` list)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()
