"""What the engine keeps quantised in memory, by where a weight is used. Torch-free; read by the loader and by
``pd-plan``, so that the planner counts the bytes the engine really holds.

* Dense linear layers (attention and MLP projections, shared experts, a quantised LM head): FP8 and int4 stay
  quantised (`pd_cluster.engine.quant.linear.QuantLinear`). MLA's ``kv_b_proj`` is the exception: the absorbed
  attention uses it as two matrices, so it is dequantised on load (as vLLM does).
* Routed MoE experts: the kinds in `EXPERT_KINDS_KEPT` stay quantised in the fused MoE kernel's weights. The
  others are dequantised into the model dtype on load (`EXPERT_KINDS_DEQUANTIZED`: FP8 and int4) or refused
  (MXFP4, which only the MoE kernel computes). The MoE code adds a kind here when its kernel takes it.
"""

from __future__ import annotations

DENSE_KINDS_KEPT: frozenset[str] = frozenset({"fp8", "int4"})
EXPERT_KINDS_KEPT: frozenset[str] = frozenset()
EXPERT_KINDS_DEQUANTIZED: frozenset[str] = frozenset({"fp8", "int4"})  # the loader's fallback for the others
DEQUANTIZED_MODULES = ("kv_b_proj",)  # used as matrices, not as linear layers (MLA's absorbed attention)
