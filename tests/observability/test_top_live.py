"""``tandem top`` against a live 1P1D cluster, headless: the screen it draws (a rich Console recording at a
fixed width) has a row per worker with its role and pid, and its numbers move when load arrives."""

from __future__ import annotations

import re

from rich.console import Console

from deploy.cli import main
from deploy.top_cmd import RouterReader, watch

WIDTH = 200


def screen_rows(screen: str) -> dict[str, dict[str, str]]:
    """worker -> {column: cell} from the table on one screen."""
    lines = [line for line in screen.splitlines() if line.count("│") >= 10 or line.count("┃") >= 10]
    header = [cell.strip() for cell in re.split(r"[│┃]", lines[0])]
    rows = {}
    for line in lines[1:]:
        cells = dict(zip(header, (cell.strip() for cell in line.split("│"))))
        rows[cells["worker"]] = cells
    return rows


def totals(screen: str) -> dict[str, float]:
    line = next(line for line in screen.splitlines() if line.startswith("requests "))
    return {"requests_per_s": float(re.search(r"requests ([0-9.]+)/s", line).group(1)),
            "in_flight": float(re.search(r"in flight (\d+)", line).group(1))}


def test_once_shows_every_worker_with_its_role_and_pid(cluster, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    assert main(["top", "--url", cluster.url, "--once", "--interval", "0.5"]) == 0
    screen = capsys.readouterr().out
    assert f"{cluster.url}  ready" in screen
    rows = screen_rows(screen)
    assert {name: row["role"] for name, row in rows.items()} == {"prefill-0": "PrefillOnly", "decode-0": "DecodeOnly"}
    assert {name: int(row["pid"]) for name, row in rows.items()} == {n: cluster.pids[n] for n in rows}
    assert all(row["restarts"] == "0" and row["state"] == "idle" for row in rows.values())
    assert totals(screen)["requests_per_s"] == 0 and all(row["TTFT"] == "-" for row in rows.values())  # no load yet


def test_once_piped_is_not_cut_to_80_columns(cluster, capsys, monkeypatch):
    """Piped (no terminal, no COLUMNS) the table keeps its own width: an audit saw pids as "30…"."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["top", "--url", cluster.url, "--once", "--interval", "0.2"]) == 0
    rows = screen_rows(capsys.readouterr().out)
    assert {name: int(row["pid"]) for name, row in rows.items()} == {n: cluster.pids[n] for n in rows}


def test_refreshes_follow_the_load(cluster, background_load):
    console = Console(record=True, width=WIDTH, force_terminal=True, color_system=None)
    background_load(num_rounds=8, concurrency=4, max_tokens=24, pause_s=0.2)
    watch(RouterReader(cluster.url), 1.0, console, cluster.url, num_refreshes=3)
    screens = [cluster.url + part for part in console.export_text().split(cluster.url)[1:] if "requests " in part]
    assert len(screens) >= 3
    busy = [screen for screen in screens if totals(screen)["requests_per_s"] > 0]
    assert busy, screens[-1]
    rows = [screen_rows(screen) for screen in busy]
    # the decode worker decoded them (TTFT and TPOT now), the KV came from the prefill worker
    assert any(r["decode-0"]["TTFT"].endswith("ms") and r["decode-0"]["TPOT"].endswith("ms") for r in rows)
    assert any(r["prefill-0"]["TTFT"].endswith("ms") and r["prefill-0"]["TPOT"] == "-" for r in rows)
    assert any(r["prefill-0"]["KV xfer"] != "0 B/s" and r["decode-0"]["KV xfer"] != "0 B/s" for r in rows)

