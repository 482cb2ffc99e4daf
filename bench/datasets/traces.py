"""Production traces: Mooncake (timestamps, lengths, prefix block hashes) and Azure LLM inference.

Mooncake (Qin et al., FAST'25): JSONL rows ``{"timestamp": ms, "input_length",
"output_length", "hash_ids"}``; hash id ``j`` of a row names its ``j``-th
prefix block of ``--trace-block-size`` (512) tokens, and rows with equal hash
ids share that block. The prompts are synthesised so that they do, token for token.

Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA'24): CSV with
``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``), ``ContextTokens``,
``GeneratedTokens``; it has no text, so prompts are random tokens of that length.

Input scaling shrinks the block size with the lengths (``round(512 * scale)``),
so the prefix structure survives fitting to a small context; a cap drops whole
trailing blocks (the last block of a prompt absorbs any rounding remainder).
"""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np

from pd_cluster.bench.config import DatasetConfig
from pd_cluster.bench.datasets.base import Dataset, SampledRequest
from pd_cluster.bench.datasets.synth import PromptSynth
from pd_cluster.bench.datasets.synthetic import measure
from pd_cluster.bench.datasets.tables import SHAPES, number, read_csv

_UNIQUE_KEY_BASE = 1 << 42


def read_mooncake(path: str, limit: int | None) -> list[dict]:
    """The first ``limit`` rows of a Mooncake JSONL trace. Raises ``ValueError`` on a bad row."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("timestamp", "input_length", "output_length"):
                if key not in row:
                    raise ValueError(f"{path}:{lineno}: missing {key!r}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def block_layout(hash_ids: list[int], length: int, block: int) -> list[tuple[int, int]]:
    """``(hash_id, n_tokens)`` per block for a prompt of ``length`` tokens; the last takes the rest."""
    out = []
    for j, h in enumerate(hash_ids):
        start = j * block
        if start >= length:
            break
        n = length - start if j == len(hash_ids) - 1 else min(block, length - start)
        out.append((int(h), n))
    return out


def mooncake_dataset(cfg: DatasetConfig, synth: PromptSynth, path: str) -> Dataset:
    rows = read_mooncake(path, cfg.num_prompts)
    sc = cfg.scaling
    block = sc.block_size(cfg.trace_block_size)
    t0 = float(rows[0]["timestamp"]) if rows else 0.0
    ids_list, meta, capped_in, capped_out = [], [], 0, 0
    for i, row in enumerate(rows):
        raw_in, raw_out = int(row["input_length"]), int(row["output_length"])
        length = sc.input_len(raw_in)
        capped_in += length < round(raw_in * sc.input_scale)
        hashes = [int(h) for h in row.get("hash_ids") or []]
        if hashes:
            ids = [t for h, n in block_layout(hashes, length, block) for t in synth.block(h, n)]
        else:
            ids = synth.block(_UNIQUE_KEY_BASE + i, length)
        ids_list.append(ids)
        out = sc.output_len(raw_out)
        capped_out += out < round(raw_out * sc.output_scale)
        meta.append(((float(row["timestamp"]) - t0) / 1000.0, out, tuple(hashes)))
    texts, lens, bad = measure(synth, ids_list)
    reqs = [SampledRequest(t, n, out, ts, h, block) for t, n, (ts, out, h) in zip(texts, lens, meta)]
    ds = Dataset("mooncake-trace", reqs, sc, capped_in, capped_out)
    ds.notes.append(f"trace {path}: {len(reqs)} rows, prefix block {cfg.trace_block_size} tokens "
                    f"(scaled to {block})")
    if bad:
        ds.notes.append(f"{bad} prompts re-encoded to a different length than built")
    return ds


def _parse_azure_time(text: str, path: str) -> datetime:
    day, _, frac = text.strip().partition(".")
    try:
        base = datetime.strptime(day, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise ValueError(f"{path}: column 'TIMESTAMP': expected YYYY-MM-DD HH:MM:SS[.f], got {text!r}") from None
    return base.replace(microsecond=int((frac + "000000")[:6])) if frac else base


def azure_dataset(cfg: DatasetConfig, synth: PromptSynth, path: str) -> Dataset:
    """Raises ``ValueError`` naming a missing column or a bad value."""
    rows = read_csv(path, SHAPES["azure-trace"], "azure-trace", cfg.num_prompts)
    sc = cfg.scaling
    rng = np.random.default_rng([cfg.seed, 3])
    times = [_parse_azure_time(r["TIMESTAMP"], path) for r in rows]
    ids_list, outs, capped_in, capped_out = [], [], 0, 0
    for r in rows:
        raw_in, raw_out = number(r, "ContextTokens", path), number(r, "GeneratedTokens", path)
        length = sc.input_len(raw_in)
        capped_in += length < round(raw_in * sc.input_scale)
        ids_list.append(synth.random_ids(rng, length))
        out = sc.output_len(raw_out)
        capped_out += out < round(raw_out * sc.output_scale)
        outs.append(out)
    texts, lens, _ = measure(synth, ids_list)
    ts = [(t - times[0]).total_seconds() for t in times]
    reqs = [SampledRequest(t, n, o, s) for t, n, o, s in zip(texts, lens, outs, ts)]
    ds = Dataset("azure-trace", reqs, sc, capped_in, capped_out)
    ds.notes.append(f"trace {path}: {len(reqs)} rows (no text in the trace: random prompts of its lengths)")
    return ds
