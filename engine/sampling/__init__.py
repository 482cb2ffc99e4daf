"""Sampling parameters, the batched sampler, structured outputs and tool calls."""

from pd_cluster.engine.sampling.params import SamplingParamError, SamplingParams
from pd_cluster.engine.sampling.structured import StructuredOutput, structured_output_from_request

__all__ = ["SamplingParamError", "SamplingParams", "StructuredOutput", "structured_output_from_request"]
