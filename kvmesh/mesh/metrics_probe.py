"""Reading another service's /metrics (tests and benchmarks: conditions and counts)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def samples(address: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of metric `name` at http://address/metrics, by its sorted labels."""
    with _OPENER.open(f"http://{address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def metric_sum(address: str, name: str) -> float:
    """The sum of metric `name` over all its labels at http://address/metrics."""
    return sum(samples(address, name).values())
