"""``tandem top --url URL``: a live terminal view of a running cluster, like htop: the router's totals
(requests/s, errors, in flight, queued, TTFT / TPOT now) and one row per worker (role, state, running and
queued requests, KV use, TTFT / TPOT now, KV transfer rate, restarts).

It reads only the router's HTTP endpoints, /metrics and /ready, so it works against any deployment
(``tandem up``, Ray, a router behind a proxy: ``--api-key`` is sent as a bearer token). Rates and "now"
values are differences between two scrapes ``--interval`` apart (``deploy.top_rows``); ``--once`` prints
one view after two scrapes and exits.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded when the command runs: every process builds the `tandem` parser
    from deploy.top_rows import Scrape, TopView


def register(sub) -> None:
    parser = sub.add_parser("top", help="live view of a running cluster (router totals, one row per worker)",
                            description="A live view of a running Tandem cluster, read from its router's "
                                        "/metrics and /ready (docs/observability.md).")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (a proxy may want it)")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S",
                        help="seconds between scrapes; rates are over this interval (default: %(default)s)")
    parser.add_argument("--once", action="store_true", help="print one view (two scrapes --interval apart) and exit")
    parser.set_defaults(handler=run)


_PIPED_WIDTH = 200  # wider than the worker table gets: lines are as long as their content


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.interval <= 0:
        raise ValueError(f"--interval: must be > 0 (got {args.interval})")
    reader = RouterReader(args.url.rstrip("/"), args.api_key)
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:  # piped or to a file: the table at its own width,
        console = Console(width=_PIPED_WIDTH)                      # not cut to 80 columns (a pid as "30…")
    if args.once:
        console.print(render(reader.view_over(args.interval), args.url))
        return 0
    watch(reader, args.interval, console, args.url)
    return 0


class RouterReader:
    """Scrapes one router and keeps the previous scrape, so each view covers the time since the last."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 5.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout_s)  # https verified (SSL_CERT_FILE: a private CA)
        self.url = url
        self._previous: Scrape | None = None

    def scrape(self) -> Scrape:
        import httpx

        from deploy.top_rows import Scrape

        try:
            metrics = self._client.get(f"{self.url}/metrics")
            metrics.raise_for_status()
            ready = self._client.get(f"{self.url}/ready")  # 503 when not ready: its JSON says why
            ready_body = ready.json() if ready.headers.get("content-type", "").startswith("application/json") else None
        except httpx.HTTPError as exc:
            raise ValueError(f"{self.url}: {exc!r}") from None
        if "tandem_requests_total" not in metrics.text:
            raise ValueError(f"{self.url}/metrics has no tandem_requests_total: not a Tandem router")
        return Scrape.parse(time.monotonic(), metrics.text, ready_body)

    def next_view(self) -> TopView | None:
        """The view since the previous call (None on the first: nothing to difference yet)."""
        from deploy.top_rows import build_view

        current = self.scrape()
        previous, self._previous = self._previous, current
        return None if previous is None else build_view(previous, current)

    def view_over(self, interval_s: float) -> TopView:
        """Two scrapes ``interval_s`` apart."""
        self.next_view()
        time.sleep(interval_s)
        return self.next_view()


def watch(reader: RouterReader, interval_s: float, console, title: str, num_refreshes: int | None = None) -> None:
    """Refresh the view every ``interval_s`` until Ctrl-C (or ``num_refreshes`` views, for tests); a router
    that does not answer is shown as such and read again at the next refresh."""
    from rich.live import Live
    from rich.text import Text

    with Live(Text(f"reading {title} ..."), console=console, auto_refresh=False) as live:
        reader.next_view()
        done = 0
        while num_refreshes is None or done < num_refreshes:
            time.sleep(interval_s)
            try:
                view = reader.next_view()
            except ValueError as exc:
                live.update(Text(f"{title}: {exc}", style="red"), refresh=True)
                continue
            if view is not None:
                live.update(render(view, title), refresh=True)
                done += 1


def render(view: TopView, title: str):
    """One view as a rich renderable: a totals line over the worker table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = view.totals
    ready = {True: ("ready", "green"), False: ("NOT READY", "bold red"), None: ("?", "")}[view.is_ready]
    header = Text.assemble(
        (f"{title}  ", "bold"), ready, f" ({view.ready_reason})\n" if view.ready_reason else "\n",
        f"requests {t.requests_per_s:.2f}/s  in flight {t.num_in_flight}  queued {t.num_queued}  ",
        (f"errors {t.errors_per_s:.2f}/s ({t.num_errors} total)", "red" if t.errors_per_s else ""),
        f"  TTFT {_ms(t.ttft_s)}  TPOT {_ms(t.tpot_s)}  (over {view.interval_s:.1f}s)",
    )
    table = Table(expand=False, pad_edge=False)
    for name, justify in (("worker", "left"), ("role", "left"), ("state", "left"), ("pid", "right"),
                          ("ranks", "right"), ("run", "right"), ("queue", "right"), ("KV used", "right"), ("TTFT", "right"),
                          ("TPOT", "right"), ("KV xfer", "right"), ("restarts", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for row in view.rows:
        table.add_row(
            row.worker, row.role, Text(row.state, style=_state_style(row.state)), str(row.pid or "-"),
            str(row.num_ranks), str(row.num_running), str(row.num_queued),
            "-" if row.kv_used_fraction is None else f"{100 * row.kv_used_fraction:.0f}%",
            _ms(row.ttft_s), _ms(row.tpot_s), _bytes_per_s(row.transfer_bytes_per_s),
            Text(str(row.num_restarts), style="red" if row.num_restarts else ""),
        )
    return Group(header, table)


def _state_style(state: str) -> str:
    if state.startswith("busy"):
        return "magenta"
    return {"dead": "bold red", "draining": "yellow"}.get(state, "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}ms"


def _bytes_per_s(rate: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if rate >= size:
            return f"{rate / size:.1f} {unit}/s"
    return f"{rate:.0f} B/s"
