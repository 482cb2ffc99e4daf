"""ShareGPT conversations: the first human turn is the prompt (vLLM's ``sharegpt`` dataset).

Accepted shapes: ``[{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}]`` and ``[{"prompt": ..., "response": ...}]``.
The output length is the reply's token count, or ``--sharegpt-output-len``.
"""

from __future__ import annotations

import json
import random

from pd_cluster.bench.config import DatasetConfig
from pd_cluster.bench.datasets.base import Dataset, SampledRequest
from pd_cluster.bench.tokenizer import Tokenizer

_HUMAN = ("human", "user")
_MIN_PROMPT_TOKENS = 4


def first_turn(entry: dict) -> tuple[str, str | None] | None:
    """(prompt, reply or None) of one entry; None when it has no human turn."""
    conv = entry.get("conversations")
    if isinstance(conv, list):
        for k, turn in enumerate(conv):
            if isinstance(turn, dict) and turn.get("from", turn.get("role")) in _HUMAN:
                nxt = conv[k + 1] if k + 1 < len(conv) and isinstance(conv[k + 1], dict) else {}
                reply = nxt.get("value", nxt.get("content"))
                return str(turn.get("value", turn.get("content", ""))), reply
        return None
    if isinstance(entry.get("prompt"), str):
        return entry["prompt"], entry.get("response") or entry.get("completion")
    return None


def sharegpt_dataset(cfg: DatasetConfig, tok: Tokenizer, path: str) -> Dataset:
    """Shuffled with the seed; prompts under 4 tokens are skipped, as in vLLM.

    Raises ``ValueError`` when an entry has no reply and ``--sharegpt-output-len`` is unset.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [p for p in (first_turn(e) for e in data if isinstance(e, dict)) if p and p[0].strip()]
    random.Random(cfg.seed).shuffle(pairs)
    want = cfg.num_prompts or len(pairs)
    sc = cfg.scaling
    reqs, capped_in, capped_out, skipped = [], 0, 0, 0
    for prompt, reply in pairs:
        if len(reqs) >= want:
            break
        ids = tok.encode(prompt)
        if len(ids) < _MIN_PROMPT_TOKENS:
            skipped += 1
            continue
        if cfg.sharegpt_output_len is not None:
            raw_out = cfg.sharegpt_output_len
        elif reply:
            raw_out = max(1, tok.count(str(reply)))
        else:
            raise ValueError(f"{path}: an entry has no reply; pass --sharegpt-output-len")
        length = sc.input_len(len(ids))
        if length < len(ids):
            prompt = tok.decode(ids[:length])
            capped_in += length < round(len(ids) * sc.input_scale)
        out = sc.output_len(raw_out)
        capped_out += out < round(raw_out * sc.output_scale)
        reqs.append(SampledRequest(prompt, tok.count(prompt), out))
    ds = Dataset("sharegpt", reqs, sc, capped_in, capped_out)
    ds.notes.append(f"{path}: {len(reqs)} prompts ({skipped} under {_MIN_PROMPT_TOKENS} tokens skipped)")
    if len(reqs) < want:
        ds.notes.append(f"asked for {want} prompts, the file has {len(reqs)} usable")
    return ds
