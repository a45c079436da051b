"""``tandem --log-level X up``: the processes the launcher starts log at X too (they were started at INFO whatever
the flag said), and a level that is not one is a usage error, not a traceback."""

from __future__ import annotations

import os

import pytest

from deploy.cli import main
from deploy.local_spawner import CHILD_LOG_LEVEL_ENV, ProcessSpawner


def spawned_argv(tmp_path, monkeypatch) -> list[str]:
    """The command line a spawned process gets (a module that prints its arguments)."""
    (tmp_path / "print_argv.py").write_text("import sys; print(' '.join(sys.argv[1:]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    spawner = ProcessSpawner(tmp_path, "print_argv", {}, use_fork_server=False)
    assert spawner.spawn("router", ["router", "--port", "1"]).wait(timeout=60) == 0
    return spawner.log_path("router").read_text().split()


def test_the_launchers_level_reaches_its_processes(tmp_path, monkeypatch):
    monkeypatch.delenv(CHILD_LOG_LEVEL_ENV, raising=False)
    assert spawned_argv(tmp_path, monkeypatch)[:2] == ["--log-level", "INFO"]  # not asked: INFO, in the log file
    monkeypatch.setenv(CHILD_LOG_LEVEL_ENV, "")  # main sets it in this process: undone after the test
    (tmp_path / "taken").write_text("x")
    assert main(["--log-level", "debug", "keygen", "--out", str(tmp_path / "taken")]) == 2  # a quick subcommand
    assert os.environ[CHILD_LOG_LEVEL_ENV] == "DEBUG"
    assert spawned_argv(tmp_path, monkeypatch)[:2] == ["--log-level", "DEBUG"]


def test_an_unknown_level_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--log-level", "bogus", "keygen", "--out", "/nonexistent/x"])
    assert exit_.value.code == 2
    assert "--log-level: one of DEBUG, INFO, WARNING, ERROR, CRITICAL (got 'bogus')" in capsys.readouterr().err
