"""The cluster's /metrics: every replica's own, each series labelled with its replica, and the
router's counts, as one Prometheus text.

The replicas' texts are parsed and written again with prometheus_client, so that each metric has
one HELP and TYPE line whatever the number of replicas, and labels stay escaped.
"""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from spanserve.cluster.routing_state import REGISTRY as ROUTING_REGISTRY

REPLICA_LABEL = "replica"


class _Replicas:
    """A collector of the families parsed from each replica's text."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, REPLICA_LABEL: replica}, sample.value,
                                    sample.timestamp)
        yield GaugeMetricFamily("spanserve_replicas_reporting", "Replicas whose metrics this scrape holds",
                                value=len(self.texts))
        yield from merged.values()


def cluster_metrics(texts: dict[str, str]) -> bytes:
    """One exposition of the replicas' texts (by replica id) and this process's routing counts."""
    registry = CollectorRegistry()
    registry.register(_Replicas(texts))
    return generate_latest(registry) + generate_latest(ROUTING_REGISTRY)
