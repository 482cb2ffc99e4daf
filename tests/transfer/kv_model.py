"""Real prefill and greedy decode of the embedded model over an engine pool, without the scheduler.

Shared by the worker processes of `kv_peer` and the single-process references in the tests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pd_cluster.engine.assets import DEFAULT_MODEL
from pd_cluster.engine.attention.mla import MLAAttentionBackend, TorchMLABackend
from pd_cluster.engine.attention.torch_ref import TorchAttentionBackend
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.loader import LoadedModel, load_model

@dataclass
class ModelPool:
    """A loaded model, a pool for it and the reference attention."""

    lm: LoadedModel
    pool: KVPool
    backend: TorchAttentionBackend | MLAAttentionBackend

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def device(self) -> torch.device:
        return self.pool.device


def make(kv_cache_dtype: str, page_size: int, num_pages: int, model: str | None = None,
         load_format: str = "auto", seed: int = 0, device: str = "cpu") -> ModelPool:
    """Load `model` (default: stories260K) and build a pool of `num_pages` pages for it on `device`."""
    lm = load_model(model or DEFAULT_MODEL, "float32", load_format, seed, device)
    a = lm.arch
    fp8 = kv_cache_dtype == "fp8_e4m3"
    ones = (1.0,) * a.num_hidden_layers
    if a.mla is not None:  # DeepSeek: a latent pool and the torch MLA backend
        m = a.mla
        layout = KVLayout(a.num_hidden_layers, 1, m.latent_dim, page_size, kv_cache_dtype,
                          tuple(lm.k_scales) if fp8 else ones, ones, kv_format="mla")
        backend = TorchMLABackend(a.num_attention_heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                  m.v_head_dim, m.softmax_scale)
        return ModelPool(lm, KVPool(layout, num_pages, device, torch.float32), backend)
    layout = KVLayout(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, page_size, kv_cache_dtype,
                      tuple(lm.k_scales) if fp8 else ones, tuple(lm.v_scales) if fp8 else ones)
    pool = KVPool(layout, num_pages, device, torch.float32)
    backend = TorchAttentionBackend(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5)
    return ModelPool(lm, pool, backend)


@torch.inference_mode()
def prefill_chunk(mp: ModelPool, ids: list[int], pages: list[int], lo: int, hi: int) -> int:
    """Run prompt tokens ``ids[lo:hi]`` (KV of ``[0, lo)`` already in `pages`); returns the greedy next token."""
    b = build_forward_batch([np.asarray(ids[lo:hi], dtype=np.int64)], [lo], [pages],
                            [np.array([hi - lo - 1])], 0, mp.page_size, mp.device)
    logits = mp.lm.model(b, mp.pool, mp.backend)
    return int(logits[-1].argmax())


@torch.inference_mode()
def greedy(mp: ModelPool, pages: list[int], pos: int, first_token: int, n: int) -> list[int]:
    """Greedy decode: `first_token` sits at position `pos` (prompt KV in `pages`); returns `n` tokens."""
    toks = [first_token]
    for i in range(n - 1):
        b = build_forward_batch([np.array([toks[-1]], dtype=np.int64)], [pos + i], [pages], [np.array([0])], 1,
                                mp.page_size, mp.device)
        toks.append(int(mp.lm.model(b, mp.pool, mp.backend)[-1].argmax()))
    return toks


def page_hashes(pool: KVPool, pages: list[int]) -> list[str]:
    """sha256 of each page's raw bytes (all layers, K and V)."""
    raw = pool.read_pages(pages).view(torch.uint8).reshape(len(pages), -1).cpu().numpy()
    return [hashlib.sha256(row.tobytes()).hexdigest() for row in raw]


def pool_hash(pool: KVPool) -> str:
    """sha256 of the whole page tensor."""
    return hashlib.sha256(pool.kv.view(torch.uint8).reshape(-1).cpu().numpy().tobytes()).hexdigest()


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def write_model_variant(out_dir: Path, **overrides) -> str:
    """A checkpoint folder with stories260K's config changed by `overrides` (for ``load_format="dummy"``)."""
    cfg = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())
    cfg.update(overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return str(out_dir)


def real_prompt(tokenizer, num_tokens: int) -> list[int]:
    """`num_tokens` ids of real text: ShareGPT prompts from the shipped slice, tokenized and concatenated."""
    data = json.loads((Path(__file__).resolve().parents[2] / "bench" / "data" / "sharegpt_300.json").read_text())
    ids: list[int] = []
    for row in data:
        text = row if isinstance(row, str) else _first_text(row)
        ids.extend(tokenizer(text).input_ids)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"the ShareGPT slice has fewer than {num_tokens} tokens")


def _first_text(row) -> str:
    if isinstance(row, dict):
        for key in ("prompt", "text", "value", "content"):
            if isinstance(row.get(key), str):
                return row[key]
        for v in row.values():
            if isinstance(v, (list, dict)):
                return _first_text(v)
    if isinstance(row, list) and row:
        return _first_text(row[0])
    return str(row)
