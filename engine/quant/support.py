"""What the engine keeps quantised in memory, by where a weight is used. Torch-free; read by the loader and by
``pd-plan``, so that the planner counts the bytes the engine really holds.

* Dense linear layers (attention and MLP projections, shared experts, a quantised LM head): FP8 and int4 stay
  quantised (`pd_cluster.engine.quant.linear.QuantLinear`). MLA's ``kv_b_proj`` is the exception: the absorbed
  attention uses it as two matrices, so it is dequantised on load (as vLLM does).
* Routed MoE experts: the kinds in `EXPERT_KINDS_KEPT` stay quantised in the fused MoE kernel's weights
  (`pd_cluster.engine.quant.experts`): FP8 (in blocks, per channel or per tensor), int4 and gpt-oss's MXFP4.
  Experts stored in another format are refused by name when the config is read
  (`pd_cluster.engine.quant.expert_format.expert_quant_of`), never dequantised.
"""

from __future__ import annotations

DENSE_KINDS_KEPT: frozenset[str] = frozenset({"fp8", "int4"})
EXPERT_KINDS_KEPT: frozenset[str] = frozenset({"fp8", "int4", "mxfp4"})  # `engine/quant/experts.py`
DEQUANTIZED_MODULES = ("kv_b_proj",)  # used as matrices, not as linear layers (MLA's absorbed attention)
