"""What lets Prometheus reach the /metrics of engines and router: pod annotations and the scrapers'
NetworkPolicy peers."""

from __future__ import annotations

from typing import Any

from pdoperator.api.model import PDService

METRICS_PATH = "/metrics"  # vLLM, the mock engine and the router all serve it on their HTTP port


def scrape_annotations(pds: PDService, port: int) -> dict[str, str]:
    """The ``prometheus.io/*`` annotations of a pod serving /metrics on ``port``, when the spec asks for
    them."""
    if not pds.spec.monitoring.pod_annotations:
        return {}
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": METRICS_PATH,
    }


def scraper_peers(pds: PDService) -> list[dict[str, Any]]:
    """``spec.monitoring.scrapers`` as NetworkPolicy peers: unset selectors stay unset, ``{}`` selects
    everything."""
    peers = []
    for scraper in pds.spec.monitoring.scrapers:
        peer: dict[str, Any] = {}
        if scraper.namespace_labels is not None:
            peer["namespaceSelector"] = {"matchLabels": dict(scraper.namespace_labels)}
        if scraper.pod_labels is not None:
            peer["podSelector"] = {"matchLabels": dict(scraper.pod_labels)}
        peers.append(peer)
    return peers
