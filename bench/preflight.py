"""Checks before a run: the server's model and context length, and requests that cannot fit."""

from __future__ import annotations

from typing import Any

import httpx

from pd_cluster.bench.datasets import Dataset


def list_models(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The ``data`` of ``GET /v1/models``. Raises ``RuntimeError`` when the server does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s, trust_env=False)
        r.raise_for_status()
        data = r.json()["data"]
        if not isinstance(data, list) or not data:
            raise ValueError("no models listed")
        return [m for m in data if isinstance(m, dict)]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot list models at {base_url}/v1/models ({exc}); pass --model") from exc


def context_length(models: list[dict[str, Any]], model: str, worker_urls: list[str],
                   timeout_s: float = 5.0) -> int | None:
    """The server's context length in tokens: ``max_model_len`` from ``/v1/models`` (vLLM,
    SGLang), else the smallest ``context_length`` in the workers' ``/server_info``; None if unknown."""
    for m in models:
        if m.get("id") == model and isinstance(m.get("max_model_len"), int):
            return int(m["max_model_len"])
    found = []
    with httpx.Client(timeout=timeout_s, trust_env=False) as c:
        for url in worker_urls:
            try:
                ctx = c.get(url.rstrip("/") + "/server_info").json().get("context_length")
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            if isinstance(ctx, int) and ctx > 0:
                found.append(ctx)
    return min(found) if found else None


def context_warning(ds: Dataset, ctx: int | None) -> str | None:
    """A warning when some requests need more than ``ctx`` tokens (prompt + output)."""
    if ctx is None:
        return None
    over = sum(1 for r in ds.requests if r.prompt_len + r.output_len > ctx)
    if not over:
        return None
    return (f"{over} of {len(ds.requests)} requests need more than the server's {ctx}-token context "
            "(prompt + output) and will likely fail; fit them with --max-input-len/--max-output-len "
            "or --input-len-scale/--output-len-scale")
