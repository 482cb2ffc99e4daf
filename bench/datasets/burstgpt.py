"""BurstGPT (Wang et al., "BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving
Systems", KDD'25; https://github.com/HPMLL/BurstGPT): Azure OpenAI GPT service logs.

CSV columns: ``Timestamp`` (seconds from the start of the log), ``Model`` (``ChatGPT`` or
``GPT-4``), ``Request tokens``, ``Response tokens``, ``Total tokens``, ``Log Type``
(``Conversation log`` or ``API log``). A row with 0 response tokens is a request that
failed in production; it is skipped, and the report says how many were. The trace has no
text, so prompts are random whole-word tokens of the logged length, and ``max_tokens`` is
the logged response length. Arrivals replay the timestamps (``--trace-speedup`` divides
the gaps) unless ``--request-rate`` is given.

vLLM's ``--dataset-name burstgpt`` differs: it keeps only ``GPT-4`` rows and samples them
at random, using ``--request-rate`` for arrivals. pd-bench replays every model's rows in
file order, at their timestamps, since the bursts are the point of the trace.
"""

from __future__ import annotations

import numpy as np

from pd_cluster.bench.config import DatasetConfig
from pd_cluster.bench.datasets.base import Dataset, SampledRequest
from pd_cluster.bench.datasets.synth import PromptSynth
from pd_cluster.bench.datasets.synthetic import measure
from pd_cluster.bench.datasets.tables import number, read_csv

COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def burstgpt_dataset(cfg: DatasetConfig, synth: PromptSynth, path: str) -> Dataset:
    """The first ``--num-prompts`` successful rows of a BurstGPT CSV.

    Raises:
        ValueError: no ``--dataset-path``, a missing column, or a value that is not a number.
    """
    if not path:
        raise ValueError("--dataset-name burstgpt needs --dataset-path: a BurstGPT CSV such as BurstGPT_1.csv "
                         "from https://github.com/HPMLL/BurstGPT (no slice ships with pd-bench)")
    skipped = 0

    def ok(row: dict[str, str]) -> bool:
        nonlocal skipped
        if number(row, "Response tokens", path) > 0:
            return True
        skipped += 1
        return False

    rows = read_csv(path, COLUMNS, "burstgpt", cfg.num_prompts, keep=ok)
    sc = cfg.scaling
    rng = np.random.default_rng([cfg.seed, 5])
    ids_list, outs, times, capped_in, capped_out = [], [], [], 0, 0
    for r in rows:
        raw_in, raw_out = number(r, "Request tokens", path), number(r, "Response tokens", path)
        length = sc.input_len(max(raw_in, 1))
        capped_in += length < round(max(raw_in, 1) * sc.input_scale)
        ids_list.append(synth.random_ids(rng, length))
        out = sc.output_len(raw_out)
        capped_out += out < round(raw_out * sc.output_scale)
        outs.append(out)
        times.append(number(r, "Timestamp", path, float))
    texts, lens, _ = measure(synth, ids_list)
    t0 = times[0] if times else 0.0
    reqs = [SampledRequest(t, n, o, s - t0) for t, n, o, s in zip(texts, lens, outs, times)]
    ds = Dataset("burstgpt", reqs, sc, capped_in, capped_out)
    ds.notes.append(f"trace {path}: {len(reqs)} rows; skipped {skipped} failed requests (rows with 0 response "
                    "tokens); no text in the trace: random prompts of its lengths")
    return ds
