"""The shipped Grafana dashboard's queries, with its variables substituted the way Grafana does, so a test
can run each one against Prometheus."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "observability" / "grafana-dashboard.json"


@dataclass
class PanelQuery:
    panel: str
    ref_id: str
    expr: str


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_queries(dashboard: dict) -> list[PanelQuery]:
    """Every target of every panel, those inside collapsed rows included."""
    queries = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            queries += [PanelQuery(inner["title"], t["refId"], t["expr"]) for t in inner.get("targets", [])]
    return queries


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``$name`` / ``${name}`` replaced by ``variables[name]``; an unknown variable is an error."""
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"the dashboard uses ${name}, which the test does not substitute")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)
