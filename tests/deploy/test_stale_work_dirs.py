"""A launcher killed by SIGKILL leaves its work dir (config, sockets, maybe a cluster key); the next `tandem up`
on the host clears it, keeping the logs, and touches nothing of a launcher that still runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from deploy.cluster_files import ClusterFiles, remove_stale_work_dirs


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def left_behind(root, pid: int, with_logs: bool):
    """A work dir as a killed launcher leaves it: config, key, a socket file, maybe its logs."""
    work_dir = root / f"tandem-{pid}-abc123"
    (work_dir / "cluster-key").mkdir(parents=True)
    (work_dir / "cluster-key" / "cluster.key_secret").write_text("secret")
    (work_dir / "cluster.yaml").write_text("cluster: {}\n")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(work_dir / "zmq-router"))
    sock.close()
    if with_logs:
        (work_dir / "logs").mkdir()
        (work_dir / "logs" / "router.log").write_text("served")
    return work_dir


def test_a_killed_launchers_files_go_and_its_logs_stay(tmp_path):
    gone = left_behind(tmp_path, dead_pid(), with_logs=False)
    logged = left_behind(tmp_path, dead_pid(), with_logs=True)
    running = left_behind(tmp_path, os.getpid(), with_logs=False)  # this process: a launcher that runs
    unrelated = tmp_path / "tandem-prometheus-xyz"  # another tool's dir of the same prefix
    unrelated.mkdir()
    assert sorted(remove_stale_work_dirs(str(tmp_path))) == sorted([gone, logged])
    assert not gone.exists()
    assert sorted(p.name for p in logged.iterdir()) == ["logs"] and (logged / "logs" / "router.log").exists()
    assert sorted(p.name for p in running.iterdir()) == ["cluster-key", "cluster.yaml", "zmq-router"]
    assert unrelated.exists()


def test_a_new_work_dir_is_named_after_its_launcher(tmp_path):
    files = ClusterFiles()
    try:
        assert files.work_dir.name.startswith(f"tandem-{os.getpid()}-") and files.work_dir.stat().st_mode & 0o077 == 0
    finally:
        files.remove(files.default_endpoint_base)
    assert not files.work_dir.exists()
