"""Weight quantisation: checkpoints as released (FP8, INT4, MXFP4) read into typed schemes, and linear layers
that keep their weights quantised in memory.

The scheme API (torch-free; the planner and the config checks use it):

* `scheme.read_quant_scheme(config, folder)`: ``config.json``'s ``quantization_config`` (or llm-compressor's
  older ``compression_config``, or a ``quantize_config.json`` / ``quant_config.json`` beside it) as a frozen
  `QuantScheme`, None for unquantised weights; `QuantConfigError` (a ValueError naming the format, the key and
  the file) for anything the engine does not compute.
* `QuantScheme.for_module(name)`: the `WeightScheme` of one checkpoint module (``model.layers.0.mlp.down_proj``,
  ``model.layers.3.mlp.experts.7.gate_proj``, gpt-oss's ``model.layers.0.mlp.experts``), None when the ignore
  lists leave it unquantised or no rule targets it.
* `WeightScheme`: ``kind`` (fp8, int4, mxfp4), ``granularity``, ``layout`` (which tensors, how packed),
  ``block``, ``group_size``, ``activations``, ``symmetric``, ``act_order``; ``bits_per_weight()`` for memory.

The types live in `weight_scheme`, compressed-tensors' reader in `compressed_tensors`. See ``docs/quantization.md``.

Routed experts (`docs/moe.md`): `mxfp4` is the OCP MX E2M1 encoding with E8M0 block scales (gpt-oss's experts),
its packing and reference dequantisation; `expert_format` (torch-free) and `experts` keep a MoE layer's experts
quantised (FP8 blocks, MXFP4) in the layout the fused MoE kernel reads, with the reference math that
dequantises one expert at a time.
"""
