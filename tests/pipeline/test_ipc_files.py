"""A process leaves no ipc:// socket files behind when it exits, and never removes a successor's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

BIND_AND_WAIT = """
import sys, zmq
from pipeline.security import BindError, bind_securely
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
try:
    bind_securely(sock, sys.argv[1])
except BindError as exc:
    print(exc, flush=True)
    sys.exit(2)
print("bound", flush=True)
if sys.stdin.readline().strip() == "close":  # close the socket, then exit when told again
    sock.close(linger=0)
    print("closed", flush=True)
    sys.stdin.readline()
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


def test_a_path_another_process_listens_on_is_refused_and_a_stale_one_is_taken():
    """Two routers on one ipc:// base: libzmq let the second replace the first's file and take its workers."""
    directory = tempfile.mkdtemp(dir="/tmp")
    path = os.path.join(directory, "router")
    first = _bind_in_a_process(f"ipc://{path}")
    second = subprocess.run([sys.executable, "-c", BIND_AND_WAIT, f"ipc://{path}"], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert second.returncode == 2 and f"cannot listen on ipc://{path}" in second.stdout
    assert "another process listens on this socket file" in second.stdout
    first.kill()  # gone without removing its file: a stale file, bound over
    first.wait()
    assert os.path.exists(path)
    _exit(_bind_in_a_process(f"ipc://{path}"))


def test_a_successors_file_at_the_same_path_stays():
    directory = tempfile.mkdtemp(dir="/tmp")
    path = os.path.join(directory, "router")
    old = _bind_in_a_process(f"ipc://{path}")
    old.stdin.write("close\n")  # it stops listening but has not exited yet
    old.stdin.flush()
    assert old.stdout.readline().strip() == "closed"
    new = _bind_in_a_process(f"ipc://{path}")  # a new router binds the same path meanwhile
    _exit(old)
    assert os.path.exists(path)
    _exit(new)
    assert not os.path.exists(path)
