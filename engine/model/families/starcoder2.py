"""StarCoder2 (``Starcoder2ForCausalLM``): torch LayerNorms with weight and bias (eps ``norm_epsilon``), a
feed-forward that is not gated (``c_proj(gelu_tanh(c_fc(x)))``, the model's ``down_proj`` and ``up_proj``),
biases on every projection (``use_bias``), one sliding window on every layer when ``sliding_window`` is set,
tied embeddings by default.

Source: transformers 5.25 ``Starcoder2Config``, ``Starcoder2MLP``, ``Starcoder2Attention``,
``Starcoder2DecoderLayer``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model import config_check as rules
from pd_cluster.engine.model.family import Family


class Starcoder2(Family):
    architecture = "Starcoder2ForCausalLM"
    name = "starcoder2"
    ignored_keys = ("attention_bias", "mlp_bias")
    weight_renames = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))

    def check_activation(self, cfg: dict[str, Any]) -> None:
        rules.check_activation(cfg, ("hidden_act",), rules.GELU_TANH,
                               f"{self.architecture}: {', '.join(rules.GELU_TANH)}")

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        bias = bool(cfg.get("use_bias", True))
        return {**super().fields(cfg), "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bias, "mlp_gated": False,
                "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": float(cfg.get("norm_epsilon", 1e-5)),
                "norm_style": "layernorm_bias"}


FAMILIES = (Starcoder2(),)
