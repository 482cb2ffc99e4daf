"""Limits on one OpenAI request that the router and the workers both enforce, so that the router refuses what
every worker would refuse before it takes admission slots for it."""

from __future__ import annotations

MAX_SEQUENCES = 1024
"""Most sequences one completions request may generate: prompts × (``best_of`` or ``n``)."""


def too_many_sequences(num_prompts: int, num_generated: int) -> str | None:
    """The refusal's message when `num_prompts` prompts × `num_generated` sequences each exceed `MAX_SEQUENCES`
    (param ``prompt``, code ``invalid_value``), else None."""
    if num_prompts * num_generated <= MAX_SEQUENCES:
        return None
    return (f"prompt: {num_prompts} prompts x {num_generated} sequences each is more than the {MAX_SEQUENCES} "
            "sequences one request may generate; split the batch")
