"""The draft model of STANDALONE speculative decoding: its weights, its own paged KV pool and page allocator, and
its forward passes.

The draft runs in the engine process, on rank 0's device, whole (never tensor-parallel), with the attention
backend the target uses. Its pool is sized from the target's pool, which is sized from the memory budget
(`pd_cluster.engine.kv.sizing`), never from the context length: it holds every token the target pool holds plus
the drafts in flight of every running request (`plan_draft_pages`). A draft model must share the target's
vocabulary (SGLang's and vLLM's rule): token ids are compared, not text.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from pd_cluster.engine.attention import get_backend, resolve_backend_name
from pd_cluster.engine.batch import build_forward_batch
from pd_cluster.engine.config import format_size
from pd_cluster.engine.kv.allocator import PageAllocator
from pd_cluster.engine.kv.pool import KVLayout, KVPool
from pd_cluster.engine.model.loader import load_model
from pd_cluster.engine.parallel.group import SINGLE

logger = logging.getLogger("engine")

_KV_DTYPE_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
FLAG = "--speculative-draft-model-path"


def plan_draft_pages(target_pages: int, max_running_requests: int, num_draft_tokens: int, page_size: int) -> int:
    """Pages of the draft pool: the target pool's (the draft never holds a token the target pool could not) plus,
    per running request, the pages its K - 1 draft tokens in flight may start and one partial page."""
    per_request = -(-max(num_draft_tokens - 1, 0) // page_size) + 1
    return target_pages + max_running_requests * per_request


def check_vocabulary(path: str, vocab_size: int, draft_vocab_size: int, tokenizer) -> None:
    """Refuse a draft model whose vocabulary is not the target's: another logits width, or (when the draft folder
    has a tokenizer) another token-to-id map.

    Raises:
        ValueError: naming ``--speculative-draft-model-path`` and both sizes or the first differing token.
    """
    if draft_vocab_size != vocab_size:
        raise ValueError(f"{FLAG} {path}: the draft model's vocabulary has {draft_vocab_size} tokens, the target's "
                         f"{vocab_size}; a draft model must use the target's tokenizer")
    if tokenizer is None or not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(path).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        diff = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:1]
        raise ValueError(f"{FLAG} {path}: the draft model's tokenizer is not the target's (first difference: "
                         f"{diff[0] if diff else 'sizes'}); a draft model must use the target's tokenizer")


class DraftModel:
    """The draft model, its pool and its allocator; with `nextn`, the target checkpoint's MTP layer
    (`pd_cluster.engine.model.nextn`) and its one-layer latent (MLA) pool.

    Args:
        path: the checkpoint folder (``--speculative-draft-model-path``).
        vocab_size: the target's logits width; tokenizer: the target's (compared with the draft folder's).
        dtype_name: ``--dtype`` (the target's setting, resolved against the draft's config).
        device: rank 0's device; attention_backend: ``--attention-backend``.
        num_pages: the draft pool's usable pages (`plan_draft_pages`); page_size: the target's.
        seed: for dummy weights (never used with a real checkpoint).

    Raises:
        ValueError: another vocabulary (`check_vocabulary`), a model with MLA attention, or a pool larger than
            the memory available; all name the flag.
    """

    def __init__(self, path: str, vocab_size: int, tokenizer, dtype_name: str, device: torch.device,
                 attention_backend: str, num_pages: int, page_size: int, seed: int = 0, nextn: bool = False) -> None:
        self.loaded = load_model(path, dtype_name, "auto", seed, device, nextn=nextn)
        arch = self.loaded.arch
        flag = FLAG if not nextn else "--speculative-algorithm NEXTN"
        check_vocabulary(path, vocab_size, arch.vocab_size, None if nextn else tokenizer)
        if arch.mla is not None and not nextn:
            raise ValueError(f"{FLAG} {path}: draft models with multi-head latent attention are not supported")
        ones = (1.0,) * arch.num_hidden_layers
        kv_dtype = _KV_DTYPE_OF[self.loaded.dtype]
        if arch.mla is not None:  # NEXTN: the MTP layer's latent KV, one layer
            self.layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=arch.mla.latent_dim, page_size=page_size,
                                   kv_cache_dtype=kv_dtype, k_scales=ones, v_scales=ones, kv_format="mla")
        else:
            self.layout = KVLayout(num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
                                   head_dim=arch.head_dim, page_size=page_size, kv_cache_dtype=kv_dtype,
                                   k_scales=ones, v_scales=ones)
        nbytes = (num_pages + 1) * self.layout.page_nbytes
        available = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda"
                     else psutil.virtual_memory().available)
        if nbytes > available:
            raise ValueError(f"{flag} {path}: the draft KV pool ({num_pages} pages, {format_size(nbytes)}) exceeds "
                             f"the {format_size(available)} available on {device}; lower --kv-cache-memory or "
                             f"--mem-fraction-static")
        self.pool = KVPool(self.layout, num_pages, device, self.loaded.dtype)
        self.allocator = PageAllocator(num_pages)
        name = resolve_backend_name(attention_backend, device)
        if arch.mla is not None:
            from pd_cluster.engine.executor.shard import _mla_backend

            self.backend = _mla_backend(name, arch, SINGLE)
        else:
            self.backend = get_backend(name, device, num_heads=arch.num_attention_heads,
                                       num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
                                       scale=arch.softmax_scale, layers=arch.layer_attention)
        self.device = device
        self.page_size = page_size
        logger.info("draft model %s: %d layers, %.2f MiB of weights; draft KV pool %d pages of %d tokens (%s), "
                    "attention backend %s", path, arch.num_hidden_layers, self.loaded.weights_nbytes / 2**20,
                    num_pages, page_size, format_size(self.pool.nbytes), name)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @torch.inference_mode()
    def next_tokens(self, rows: list[tuple[list[int], int, list[int]]], decode: bool) -> list[int]:
        """One forward pass; the greedy next token after each row's last token.

        Args:
            rows: per request, (its new tokens, the position of the first, its draft block table covering them).
            decode: every row has exactly one new token.

        Returns:
            The argmax of the draft's logits at each row's last token.
        """
        logits = self.loaded.model(self._batch(rows, decode), self.pool, self.backend)
        return logits.argmax(dim=-1).tolist()

    @torch.inference_mode()
    def mtp_step(self, rows: list[tuple[list[int], int, list[int]]], decode: bool, hidden: torch.Tensor
                 ) -> tuple[list[int], torch.Tensor]:
        """NEXTN: one MTP pass (`NextNModel`); rows as `next_tokens`, `hidden` [sum of row lengths, hidden_size]
        the h_t of each input token. Returns the greedy tokens and the final-norm output [len(rows), hidden_size]
        at each row's last token (the next pass's h)."""
        logits, h = self.loaded.model(self._batch(rows, decode), self.pool, self.backend, hidden)
        return logits.argmax(dim=-1).tolist(), h

    def _batch(self, rows: list[tuple[list[int], int, list[int]]], decode: bool):
        return build_forward_batch([np.asarray(t, dtype=np.int64) for t, _, _ in rows], [s for _, s, _ in rows],
                                   [bt for _, _, bt in rows], [np.asarray([len(t) - 1]) for t, _, _ in rows],
                                   len(rows) if decode else 0, self.page_size, self.device)


class PagedDraftProposer:
    """What STANDALONE's and NEXTN's proposers share: a `DraftModel`, each request's pages of its pool (a
    sequence object with a ``pages`` list, `seqs`), freed when the request leaves, and the time spent drafting.

    Args:
        model: the draft model (or MTP layer) with its pool.
        max_tokens_per_forward: the most tokens one catch-up pass computes (``--chunked-prefill-size``).
    """

    def __init__(self, model: DraftModel, max_tokens_per_forward: int) -> None:
        self.model = model
        self.page_size = model.page_size
        self.cap = max(max_tokens_per_forward, 1)
        self.seqs: dict = {}
        self.num_pool_full = 0  # drafts skipped because the pool had no page
        self.seconds = 0.0  # wall-clock spent drafting (the passes and their host work)
        self.num_caught_up = 0  # entries computed for known tokens (prompts, accepted tokens)

    def release(self, request_id: str) -> None:
        """`request_id` left the running set: its pages go back to the pool."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.pages:
            self.model.allocator.free(seq.pages)

    def propose(self, work: list) -> dict[str, list[int]]:
        """Draft tokens for each (request, k) in `work` (k >= 1): a request id to its k greedy draft tokens; a
        request the pool has no room for (or, NEXTN, without the hidden states it needs) gets none."""
        started = time.perf_counter()
        try:
            return self._propose(work)
        finally:
            self.seconds += time.perf_counter() - started

    def _propose(self, work: list) -> dict[str, list[int]]:
        raise NotImplementedError

    def _hold(self, pages: list[int], slots: int) -> bool:
        """Make `pages` exactly the pages of `slots` tokens: free those past them, allocate what is missing;
        False (nothing allocated) when the pool has no room."""
        keep = -(-slots // self.page_size)
        if len(pages) > keep:
            self.model.allocator.free(pages[keep:])
            del pages[keep:]
        need = keep - len(pages)
        if need > 0:
            if not self.model.allocator.can_allocate(need):
                return False
            pages.extend(self.model.allocator.allocate(need))
        return True
