"""The result file of ``--save-result``: JSON with the config, summary, breakdown and per-request records."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from datetime import datetime
from typing import Any

from pd_cluster.bench.client import RequestRecord

FORMAT_VERSION = 1


def record_dict(r: RequestRecord, detailed: bool) -> dict[str, Any]:
    """One request as saved (times in seconds; ``planned``/``started``/``sent`` from the run's start)."""
    d = {"index": r.index, "request_id": r.request_id, "success": r.success, "status": r.status,
         "reason": r.reason, "error": r.error, "prompt_len": r.prompt_len, "max_tokens": r.max_tokens,
         "output_tokens": r.output_tokens, "output_tokens_from": r.output_source,
         "planned_s": r.planned, "started_s": r.started, "sent_s": r.sent, "ttft_s": r.ttft,
         "tpot_s": r.tpot, "latency_s": r.latency, "num_chunks": r.num_chunks, "itl_s": r.itl}
    if detailed:
        d["generated_text"] = r.text
    return d


def clean(obj: Any) -> Any:
    """JSON-safe copy: dataclasses to dicts, tuples to lists, NaN/inf to None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return clean(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def default_filename(dataset: str, rate: str, concurrency: int | None, model: str, when: datetime) -> str:
    model_part = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(model.rstrip("/")) or "model")
    conc = f"-concurrency{concurrency}" if concurrency else ""
    return f"pd-bench-{dataset}-{rate}qps{conc}-{model_part}-{when:%Y%m%d-%H%M%S}.json"


def save(path: str, result: dict[str, Any]) -> str:
    """Write ``result`` to ``path`` (folders created). Returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(result), f, indent=1, allow_nan=False)
        f.write("\n")
    return path


def load(path: str) -> dict[str, Any]:
    """Read a result file. Raises ``ValueError`` when it is not a pd-bench result."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "summary" not in data:
        raise ValueError(f"{path} is not a pd-bench result (no 'summary')")
    return data
