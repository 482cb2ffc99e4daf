"""What every dataset produces: the requests to send, and how their lengths were fitted."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_cluster.bench.config import LengthScaling


@dataclass(frozen=True, slots=True)
class SampledRequest:
    """One request to send.

    ``prompt_len`` is measured with the target's tokenizer (no special tokens);
    ``output_len`` is the ``max_tokens`` asked for; ``timestamp`` is the arrival
    offset in seconds from the trace's first request (None outside traces);
    ``hash_ids`` are the prompt's prefix blocks (Mooncake), each ``block_size`` tokens.
    """

    prompt: str
    prompt_len: int
    output_len: int
    timestamp: float | None = None
    hash_ids: tuple[int, ...] = ()
    block_size: int = 0


@dataclass
class Dataset:
    """The sampled requests plus facts about them that every report states."""

    name: str
    requests: list[SampledRequest]
    scaling: LengthScaling = field(default_factory=LengthScaling)
    num_capped_input: int = 0
    num_capped_output: int = 0
    notes: list[str] = field(default_factory=list)

    def scaling_line(self) -> str:
        line = f"Length scaling: {self.scaling.describe()}"
        if self.num_capped_input or self.num_capped_output:
            line += f"; capped: {self.num_capped_input} inputs, {self.num_capped_output} outputs"
        return line
