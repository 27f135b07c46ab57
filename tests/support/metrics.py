"""Prometheus helpers of the tests: scrape a ``/metrics``, read a sample, the names a dashboard queries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "sequin-dashboard.json"
METRICS_PAGE = ROOT / "docs" / "metrics.md"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def scrape(url: str, client: httpx.Client | None = None) -> list[Sample]:
    """Every sample of a ``/metrics`` page, parsed by Prometheus' own parser (a malformed page raises)."""
    response = (client or httpx).get(url, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain"), response.headers
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def exported_names(url: str, client: httpx.Client | None = None) -> set[str]:
    """The names a ``/metrics`` page exports: each family's, and its samples' (``_total``, ``_bucket``...)."""
    response = (client or httpx).get(url, timeout=30)
    names: set[str] = set()
    for family in text_string_to_metric_families(response.text):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(s.name for s in family.samples)
    return names


def family_names(url: str) -> set[str]:
    """The ``sequin_`` metrics a ``/metrics`` page exports as the docs name them: a counter with its
    ``_total``, a histogram or gauge by its own name (the ``_created`` series prometheus-client adds
    to counters and histograms left out)."""
    response = httpx.get(url, timeout=30)
    return {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(response.text)
        if family.name.startswith("sequin_") and not family.name.endswith("_created")
    }


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The value of the one sample ``name`` whose labels include ``labels``; None when there is none."""
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    return found[0] if found else None


def dashboard_queries() -> list[str]:
    """The PromQL expressions of every panel's targets."""
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in board["panels"] for t in panel.get("targets", []) if t.get("expr")]


def queried_names(expressions: list[str]) -> set[str]:
    """The metric names the expressions select (every ``sequin_…`` word)."""
    return {name for expr in expressions for name in re.findall(r"\bsequin_[a-z0-9_]+", expr)}


def documented_names() -> set[str]:
    """The metric names the metrics page's tables list (first column, backticked)."""
    return {
        name
        for line in METRICS_PAGE.read_text().splitlines()
        if line.startswith("| `sequin_")
        for name in re.findall(r"`(sequin_[a-z0-9_]+)`", line.split("|")[1])
    }
