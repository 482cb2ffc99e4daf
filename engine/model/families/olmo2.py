"""OLMo 2 (``Olmo2ForCausalLM``): norms after attention and after the MLP only (none before them), RMSNorms that
multiply in float32, and one RMSNorm over all of q's heads (``q_norm``, ``heads * head_dim`` wide) and one over
all of k's before RoPE; ``attention_bias`` on q, k, v and o.

Source: transformers 5.25 ``Olmo2Config``, ``Olmo2Attention``, ``Olmo2DecoderLayer``.
"""

from __future__ import annotations

from typing import Any

from pd_cluster.engine.model.families.llama import Llama


class Olmo2(Llama):
    architecture = "Olmo2ForCausalLM"
    name = "olmo2"
    attention_bias_built = True

    def fields(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(cfg), "o_proj_bias": bool(cfg.get("attention_bias")), "qk_norm": "rms_across",
                "norm_style": "float", "norm_layout": "post"}


FAMILIES = (Olmo2(),)
