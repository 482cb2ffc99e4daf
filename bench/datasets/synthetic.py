"""Synthetic datasets: ``random`` (vLLM's) and ``generated-shared-prefix`` (SGLang's)."""

from __future__ import annotations

import numpy as np

from pd_cluster.bench.config import DatasetConfig
from pd_cluster.bench.datasets.base import Dataset, SampledRequest
from pd_cluster.bench.datasets.synth import PromptSynth

_RANDOM_PREFIX_KEY = 1 << 41
_GSP_KEY_BASE = 1 << 40


VERIFY_SAMPLE = 32


def measure(synth: PromptSynth, ids_list: list[list[int]]) -> tuple[list[str], list[int], int]:
    """Decode prompts and measure them with the tokenizer.

    Prompts built from the safe vocabulary re-encode to exactly their ids, so
    ``VERIFY_SAMPLE`` evenly spaced prompts are re-encoded to check it (some
    tokenizers take tens of ms per long prompt); if any differs, all are measured.
    Returns the texts, their token counts, and how many differ from the ids they were built from.
    """
    texts = [synth.text(ids) for ids in ids_list]
    if not texts:
        return [], [], 0
    step = max(1, len(texts) // VERIFY_SAMPLE)
    sample = list(range(0, len(texts), step))[:VERIFY_SAMPLE] + [len(texts) - 1]
    got = synth.tok.encode_batch([texts[i] for i in sample])
    if all(g == ids_list[i] for g, i in zip(got, sample)):
        return texts, [len(ids) for ids in ids_list], 0
    lens = [len(e) for e in synth.tok.encode_batch(texts)]
    mismatched = sum(1 for n, ids in zip(lens, ids_list) if n != len(ids))
    return texts, lens, mismatched


def length_range(mean: int, ratio: float) -> tuple[int, int]:
    """vLLM's symmetric range ``[mean*(1-ratio), mean*(1+ratio)]`` (inclusive ints)."""
    return max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))


def random_dataset(cfg: DatasetConfig, synth: PromptSynth) -> Dataset:
    """``--dataset-name random``: random whole-word tokens, lengths uniform in vLLM's range.

    The first ``--random-prefix-len`` tokens are the same in every prompt.
    """
    n = cfg.num_prompts or 1000
    rng = np.random.default_rng([cfg.seed, 1])
    lo, hi = length_range(cfg.random_input_len, cfg.random_range_ratio)
    in_lens = rng.integers(lo, hi + 1, size=n)
    lo, hi = length_range(cfg.random_output_len, cfg.random_range_ratio)
    out_lens = rng.integers(lo, hi + 1, size=n)
    sc = cfg.scaling
    prefix = synth.block(_RANDOM_PREFIX_KEY, sc.block_size(cfg.random_prefix_len)) if cfg.random_prefix_len else []
    ids_list, outs, capped_in, capped_out = [], [], 0, 0
    for i in range(n):
        raw = len(prefix) + int(in_lens[i])
        total = sc.input_len(raw)
        capped_in += total < round(raw * sc.input_scale)
        body = synth.random_ids(rng, max(0, total - len(prefix)))
        ids_list.append((prefix + body)[:total])
        out = sc.output_len(int(out_lens[i]))
        capped_out += out < round(int(out_lens[i]) * sc.output_scale)
        outs.append(out)
    texts, lens, bad = measure(synth, ids_list)
    reqs = [SampledRequest(t, n_tok, o) for t, n_tok, o in zip(texts, lens, outs)]
    ds = Dataset("random", reqs, sc, capped_in, capped_out)
    _note_mismatch(ds, bad)
    return ds


def shared_prefix_dataset(cfg: DatasetConfig, synth: PromptSynth) -> Dataset:
    """``--dataset-name generated-shared-prefix``: groups sharing a system prompt, then a question.

    ``gsp_num_groups * gsp_prompts_per_group`` prompts, shuffled with the seed
    (capped by ``--num-prompts``). Within a group the system prompt's tokens are identical.
    """
    sc = cfg.scaling
    rng = np.random.default_rng([cfg.seed, 2])
    sys_len = sc.block_size(cfg.gsp_system_prompt_len)
    q_len = sc.block_size(cfg.gsp_question_len)
    out = sc.output_len(cfg.gsp_output_len)
    ids_list, capped = [], 0
    for g in range(cfg.gsp_num_groups):
        system = synth.block(_GSP_KEY_BASE + g, sys_len)
        for _ in range(cfg.gsp_prompts_per_group):
            ids = system + synth.random_ids(rng, q_len)
            if sc.max_input_len is not None and len(ids) > sc.max_input_len:
                ids, capped = ids[: sc.max_input_len], capped + 1
            ids_list.append(ids)
    order = rng.permutation(len(ids_list))
    if cfg.num_prompts is not None:
        order = order[: cfg.num_prompts]
    ids_list = [ids_list[i] for i in order]
    texts, lens, bad = measure(synth, ids_list)
    capped_out = int(out < round(cfg.gsp_output_len * sc.output_scale)) * len(texts)
    reqs = [SampledRequest(t, n_tok, out, block_size=sys_len) for t, n_tok in zip(texts, lens)]
    ds = Dataset("generated-shared-prefix", reqs, sc, capped, capped_out)
    ds.notes.append(f"{cfg.gsp_num_groups} groups x {cfg.gsp_prompts_per_group} prompts: "
                    f"system prompt {sys_len} tokens, question {q_len} tokens, output {out} tokens")
    _note_mismatch(ds, bad)
    return ds


def _note_mismatch(ds: Dataset, bad: int) -> None:
    if bad:
        ds.notes.append(f"{bad} prompts re-encoded to a different length than built; measured lengths are used")
