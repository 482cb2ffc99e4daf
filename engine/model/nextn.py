"""DeepSeek-V3's multi-token-prediction (MTP) layer as a one-layer model, for NEXTN speculative decoding.

The release stores the MTP module as the layer after the last decoder layer, ``model.layers.{N}.`` with
N = ``num_hidden_layers`` (``num_nextn_predict_layers`` of them; the engine reads the first): ``enorm``,
``hnorm``, ``eh_proj``, a full decoder block (MLA attention; an MoE MLP by DeepSeek's layer rule),
``shared_head.norm``, ``shared_head.head``, and ``embed_tokens`` (the target's embedding; the target's
``model.embed_tokens`` is used when the layer has none).

At position t it takes the target's hidden state h_t (the final-norm output, as SGLang's and vLLM's DeepSeek
MTP take it) and the embedding of token t + 1, and predicts token t + 2:
``x = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])`` (embedding first, the order of SGLang's and vLLM's
``deepseek_nextn``/``deepseek_mtp``; DeepSeek-V3 technical report sec. 2.2), then the block, then
``shared_head.norm`` (whose output chains into the next draft step as the next h) and ``shared_head.head``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from pd_cluster.engine.batch import ForwardBatch
from pd_cluster.engine.model.arch import ArchConfig
from pd_cluster.engine.model.decoder import CausalLM
from pd_cluster.engine.model.families.deepseek import deepseek_moe_layers
from pd_cluster.engine.model.layers import Norm
from pd_cluster.engine.kv.pool import KVPool
from pd_cluster.engine.parallel.group import SINGLE, TPGroup
from pd_cluster.engine.quant.modules import make_linear

FLAG = "--speculative-algorithm NEXTN"
_OWN = {"enorm": "model.enorm", "hnorm": "model.hnorm", "eh_proj": "model.eh_proj",
        "shared_head.norm": "model.norm", "shared_head.head": "lm_head", "embed_tokens": "model.embed_tokens"}


def nextn_arch(folder: Path, names: set[str]) -> tuple[ArchConfig, Callable[[str], str | None]]:
    """The MTP layer's architecture (the target's, with one decoder layer that is MoE where DeepSeek's rule
    makes layer N one) and the map from checkpoint names to the one-layer model's (None: not read).

    Args:
        folder: the target's checkpoint folder; names: every tensor name stored there.

    Raises:
        ValueError: no ``num_nextn_predict_layers`` in config.json, or no MTP tensors in the weights; both name
            the flag.
    """
    cfg = json.loads((folder / "config.json").read_text())
    count = int(cfg.get("num_nextn_predict_layers") or 0)
    if count < 1:
        raise ValueError(f"{FLAG}: {folder} has no multi-token-prediction layer (config.json has no "
                         f"num_nextn_predict_layers); use another --speculative-algorithm")
    n = int(cfg["num_hidden_layers"])
    prefix = f"model.layers.{n}."
    if prefix + "eh_proj.weight" not in names:
        raise ValueError(f"{FLAG}: config.json of {folder} gives num_nextn_predict_layers {count} but the weights "
                         f"have no {prefix}eh_proj.weight")
    moe = n in deepseek_moe_layers({**cfg, "num_hidden_layers": n + 1})
    one = {**cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0 if moe else 1, "moe_layer_freq": 1}
    arch = ArchConfig.from_dict(one, folder)
    own_embed = prefix + "embed_tokens.weight" in names

    def rename(name: str) -> str | None:
        if name == "model.embed_tokens.weight":
            return None if own_embed else name
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        for part, to in _OWN.items():
            if rest.startswith(part + "."):
                return to + rest[len(part):]
        return "model.layers.0." + rest

    return arch, rename


class NextNModel(CausalLM):
    """The MTP layer: `CausalLM`'s embedding, one decoder layer, final norm (``shared_head.norm``) and head
    (``shared_head.head``), plus ``enorm``, ``hnorm`` and ``eh_proj`` [hidden, 2 * hidden]."""

    def __init__(self, cfg: ArchConfig, tp: TPGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().__init__(cfg, tp, expert_parallel)
        self.enorm = Norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        self.hnorm = Norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        self.eh_proj = make_linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, backend, hidden: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP pass.

        Args:
            batch: token t + 1 of each row (``input_ids`` [T]) at the row's position; pool: the MTP's one-layer
                KV pool; backend: its MLA backend.
            hidden: [T, hidden_size] the hidden state h_t of each row (the target's, or the previous MTP pass's).

        Returns:
            (logits [len(logits_indices), vocab] float32, the final-norm output at those rows [.., hidden_size]).
        """
        e = self.embed_tokens(batch.input_ids)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))
        cos_sin = self._cos_sin(self.ropes[0], batch, self.layer_ops.cos_sin_dtype(x.dtype))
        backend.prepare(batch, pool)
        x, residual = self.layers[0](x, None, cos_sin, batch, pool, backend)
        rows = batch.logits_indices
        h = self.norm(x[rows], residual[rows])[0]
        return self._final_logits(self.lm_head(h)).float(), h
