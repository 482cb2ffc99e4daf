"""The Prometheus text of a DP-attention decode instance: every DP rank's metrics, each sample labelled ``dp_rank``.

A decode instance of N DP ranks (`pd_cluster.decode.dp_instance`) is N decode servers, each with its own engine,
KV pool and registry. The instance's ``GET /metrics`` (`pd_cluster.decode.dp_dispatch.DPDispatch`) answers all of
them in one exposition: each family once, with every rank's samples under a ``dp_rank`` label (SGLang's label of
a DP rank's scheduler metrics), so one scrape of the instance's URL sees every rank.
"""

from __future__ import annotations

import logging

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

logger = logging.getLogger("pd.decode")


class _Families:
    """A collector of already-built families (what `generate_latest` reads)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_rank_metrics(texts: list[str | None]) -> bytes:
    """One Prometheus text exposition of every rank's `texts` (rank order; None: a rank that did not answer,
    left out, as is one whose text is not Prometheus' format), each sample with ``dp_rank="<rank>"`` added to
    its labels."""
    families: dict[str, Metric] = {}
    for rank, text in enumerate(texts):
        try:
            parsed = list(text_string_to_metric_families(text)) if text is not None else []
        except ValueError:
            logger.warning("DP rank %d's /metrics is not Prometheus text: left out", rank)
            continue
        for fam in parsed:
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples += [Sample(s.name, {**s.labels, "dp_rank": str(rank)}, s.value, s.timestamp, s.exemplar)
                            for s in fam.samples]
    return generate_latest(_Families(list(families.values())))
