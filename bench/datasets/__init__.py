"""Datasets for pd-bench (``--dataset-name``). :func:`load_dataset` builds the requests of one run."""

from __future__ import annotations

from pathlib import Path

from pd_cluster.bench.config import DatasetConfig
from pd_cluster.bench.datasets.base import Dataset, LengthScaling, SampledRequest
from pd_cluster.bench.tokenizer import Tokenizer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DATASET_NAMES = ("random", "sharegpt", "generated-shared-prefix", "mooncake-trace", "azure-trace", "burstgpt")
TRACE_DATASETS = ("mooncake-trace", "azure-trace", "burstgpt")
DEFAULT_PATHS = {
    "sharegpt": DATA_DIR / "sharegpt_50_with_responses.json",
    "mooncake-trace": DATA_DIR / "mooncake_conversation_1000.jsonl",
    "azure-trace": DATA_DIR / "azure_code_1000.csv",
}

__all__ = ["Dataset", "LengthScaling", "SampledRequest", "DATASET_NAMES", "TRACE_DATASETS", "load_dataset"]


def load_dataset(cfg: DatasetConfig, tok: Tokenizer) -> Dataset:
    """The requests of ``cfg.name``; files default to the slices shipped in ``bench/data``.

    Raises ``ValueError`` for an unknown dataset and ``OSError`` for an unreadable file.
    """
    from pd_cluster.bench.datasets.burstgpt import burstgpt_dataset
    from pd_cluster.bench.datasets.sharegpt import sharegpt_dataset
    from pd_cluster.bench.datasets.synth import PromptSynth
    from pd_cluster.bench.datasets.synthetic import random_dataset, shared_prefix_dataset
    from pd_cluster.bench.datasets.traces import azure_dataset, mooncake_dataset

    if cfg.name not in DATASET_NAMES:
        raise ValueError(f"unknown --dataset-name {cfg.name!r}; one of {DATASET_NAMES}")
    path = cfg.path or str(DEFAULT_PATHS.get(cfg.name, ""))
    if cfg.name == "sharegpt":
        return sharegpt_dataset(cfg, tok, path)
    synth = PromptSynth(tok, cfg.seed, chunk=cfg.trace_block_size)
    if cfg.name == "random":
        return random_dataset(cfg, synth)
    if cfg.name == "generated-shared-prefix":
        return shared_prefix_dataset(cfg, synth)
    if cfg.name == "mooncake-trace":
        return mooncake_dataset(cfg, synth, path)
    if cfg.name == "burstgpt":
        return burstgpt_dataset(cfg, synth, path)
    return azure_dataset(cfg, synth, path)
