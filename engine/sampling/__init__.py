"""Sampling parameters, the batched sampler and structured outputs.

OpenAI tool calls are the server's (`pd_cluster.serving.tools`); forced ones reach the engine as a `StructuredOutput`.
"""

from pd_cluster.engine.errors import SamplingParamError
from pd_cluster.engine.sampling.params import SamplingParams
from pd_cluster.engine.sampling.structured import StructuredOutput, structured_output_from_request

__all__ = ["SamplingParamError", "SamplingParams", "StructuredOutput", "structured_output_from_request"]
