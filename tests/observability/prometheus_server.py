"""A real Prometheus as a child process for tests: the repository's deploy/observability/prometheus.yml
pointed at one router, scraping every second, its storage in a temp dir, its HTTP API on a free loopback
port. Never the system service: ``stop()`` ends the one process it started, by pid."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from tests.cluster.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = REPO_ROOT / "deploy" / "observability" / "prometheus.yml"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    def __init__(self, binary: str, router_url: str, scrape_interval: str = "1s") -> None:
        self.binary = binary
        self.target = router_url.split("://", 1)[1].rstrip("/")  # host:port
        self.scrape_interval = scrape_interval
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def job(self) -> str:
        return self.config()["scrape_configs"][0]["job_name"]

    def config(self) -> dict:
        """The shipped config, with this router as its one target and a short scrape interval."""
        config = yaml.safe_load(SHIPPED_CONFIG.read_text())
        config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = self.scrape_interval
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [self.target]
        return config

    def start(self, timeout_s: float = 20.0) -> "PrometheusServer":
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config()))
        log = open(self.workdir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self._is_ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def _is_ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (``/api/v1/query``); raises on a query Prometheus refuses."""
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        if body.get("status") != "success":
            raise AssertionError(f"prometheus refused {expr!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        """What a dashboard variable's ``label_values(match, label)`` lists (``/api/v1/label/<label>/values``)."""
        body = httpx.get(f"{self.url}/api/v1/label/{label}/values", params={"match[]": match}, timeout=10).json()
        assert body.get("status") == "success", body
        return body["data"]

    def wait_for_scrapes(self, num_scrapes: int, timeout_s: float = 20.0) -> None:
        """Wait until the router target is up and scraped ``num_scrapes`` more times from now."""
        def num_samples() -> int:
            result = self.query(f'count_over_time(up{{job="{self.job}"}}[10m])')
            return int(float(result[0]["value"][1])) if result else 0

        deadline = time.monotonic() + timeout_s
        want = num_samples() + num_scrapes
        while num_samples() < want or not self.query(f'up{{job="{self.job}"}} == 1'):
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not scrape the router:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, num_lines: int = 20) -> str:
        path = self.workdir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:]) if path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        shutil.rmtree(self.workdir, ignore_errors=True)
