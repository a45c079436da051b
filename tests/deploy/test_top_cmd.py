"""``tandem top``'s command line without a cluster: bad flags and a router that does not answer are one-line
errors (exit 2), not tracebacks."""

from __future__ import annotations

from deploy.cli import main
from tests.cluster.conftest import free_port


def test_a_router_that_does_not_answer_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["top", "--url", url, "--once", "--interval", "0.1"]) == 2
    assert f"tandem top: error: {url}" in capsys.readouterr().err


def test_the_interval_must_be_positive(capsys):
    assert main(["top", "--interval", "0", "--once"]) == 2
    assert "--interval: must be > 0" in capsys.readouterr().err
