"""A process leaves no ipc:// socket files behind when it exits, and never removes a successor's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

BIND_AND_WAIT = """
import sys, zmq
from pipeline.security import bind_securely
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
bind_securely(sock, sys.argv[1])
print("bound", flush=True)
sys.stdin.readline()  # exit when told
"""


def _bind_in_a_process(endpoint: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", BIND_AND_WAIT, endpoint], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert process.stdout.readline().strip() == "bound"
    return process


def _exit(process: subprocess.Popen) -> None:
    process.communicate("\n", timeout=30)
    assert process.returncode == 0


def test_the_socket_file_goes_with_the_process_that_bound_it():
    directory = tempfile.mkdtemp(dir="/tmp")
    path = os.path.join(directory, "router")
    process = _bind_in_a_process(f"ipc://{path}")
    assert os.path.exists(path)
    _exit(process)
    assert not os.path.exists(path)


def test_a_successors_file_at_the_same_path_stays():
    directory = tempfile.mkdtemp(dir="/tmp")
    path = os.path.join(directory, "router")
    old = _bind_in_a_process(f"ipc://{path}")
    new = _bind_in_a_process(f"ipc://{path}")  # a restarted router binds the same path while the old one drains
    _exit(old)
    assert os.path.exists(path)
    _exit(new)
    assert not os.path.exists(path)
