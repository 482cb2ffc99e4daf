"""The decode worker: OpenAI API, page reservation, KV received over NIXL, the continuous decode batch."""
