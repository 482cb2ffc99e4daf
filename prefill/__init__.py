"""The prefill worker: chunked prefill, pushing each chunk's KV pages to a decode worker over NIXL."""
