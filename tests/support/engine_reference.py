"""transformers references for the engine tests.

`RoundingCache` stores K and V in a given dtype (bf16, fp16 or FP8 E4M3 with
the pool's clamp), so transformers computes exactly what a KV pool of that
dtype holds: the honest reference for a quantised pool.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from pd_cluster.engine.assets import DEFAULT_MODEL

PROMPTS = [
    "Once upon a time, there was a little dog named Max who",
    "The sun was shining and the birds were singing in the tall green trees.",
    "Lily and Tom went to the park with their mom. They wanted to",
    "One day, a little bird flew down from the sky and landed on",
    "Sam had a red ball. He liked to throw it high in the air, but one day",
    "Mom said, \"Let's go to the store and buy some",
    "There was a big, friendly bear who lived in the forest. Every morning he",
    "Anna found a shiny key under her bed. She wondered what it could open, so she",
]
"""Eight TinyStories-style prompts, each longer than 7 tokens."""

KV_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp8_e4m3": torch.float8_e4m3fn}


class RoundingCache(DynamicCache):
    """A DynamicCache that rounds K and V to `dtype` before storing them."""

    def __init__(self, dtype: torch.dtype, **kwargs):
        super().__init__(**kwargs)
        self.kv_dtype = dtype

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        if self.kv_dtype == torch.float8_e4m3fn:
            return x.clamp(-448.0, 448.0).to(self.kv_dtype).to(x.dtype)
        return x.to(self.kv_dtype).to(x.dtype)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self._round(key_states), self._round(value_states), layer_idx, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def hf_model(path: str = DEFAULT_MODEL):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=None)
def hf_greedy(prompt: str, max_new_tokens: int = 64, kv_dtype: str = "fp32") -> tuple[int, ...]:
    """transformers' greedy continuation of `prompt` (one prompt at a time, no padding)."""
    model, tok = hf_model()
    ids = tok(prompt, return_tensors="pt").input_ids
    cache = RoundingCache(KV_TORCH_DTYPES[kv_dtype], config=model.config)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, past_key_values=cache,
                             min_new_tokens=max_new_tokens)
    return tuple(out[0, ids.shape[1]:].tolist())


def hf_prompt_logprobs(ids: list[int]) -> list[float]:
    """transformers' log-softmax of the logits at each prompt position, at the next prompt token (fp32):
    ``len(ids) - 1`` values, the reference for ``echo`` / ``prompt_logprobs``."""
    model, _ = hf_model()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
    return [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
