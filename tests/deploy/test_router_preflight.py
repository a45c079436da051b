"""What would stop a router is one line naming the flag, before anything starts (an audit saw tracebacks, some after
every worker of a `tandem up` had started): a port out of range or in use, TLS files that do not load, an ipc
directory that is not there, a file the user named that cannot be written."""

from __future__ import annotations

import os
import socket

import pytest
import zmq

from deploy.cli import main
from pipeline.endpoints import router_endpoint
from tests.cluster.conftest import free_port


@pytest.fixture
def busy_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def one_line_error(capsys) -> str:
    error = capsys.readouterr().err
    assert "Traceback" not in error and error.count("\n") == 1, error
    return error


def test_a_port_out_of_range_is_refused_by_the_parser(capsys):
    for argv in (["router", "--port", "99999"], ["up", "--port", "70000"], ["up", "--port", "http"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "--port" in capsys.readouterr().err


def test_the_router_says_what_would_stop_it(capsys, busy_port, tmp_path):
    base = f"ipc://{tmp_path}/no-such-dir/t"
    assert main(["router", "--port", "0", "--zmq-endpoint-base", base]) == 2
    assert "--zmq-endpoint-base: the router cannot listen on " in one_line_error(capsys)
    assert main(["router", "--port", str(busy_port), "--zmq-endpoint-base", f"ipc://{tmp_path}/t"]) == 2
    assert f"--port {busy_port}: cannot listen on 127.0.0.1:{busy_port}" in one_line_error(capsys)
    pem = tmp_path / "bad.pem"
    pem.write_text("not a pem\n")
    assert main(["router", "--port", "0", "--zmq-endpoint-base", f"ipc://{tmp_path}/t", "--ssl-keyfile", str(pem),
                 "--ssl-certfile", str(pem)]) == 2
    assert f"--ssl-certfile {pem} / --ssl-keyfile {pem}: not a PEM certificate" in one_line_error(capsys)


def test_a_router_base_another_router_listens_on_is_refused_and_left_alone(capsys, tmp_path):
    """The check's own probe bind used to replace the live router's socket file (libzmq unlinks it first): the
    second router was refused later, but the first could no longer be reached by a restarted worker."""
    base = f"ipc://{tmp_path}/t"
    path = router_endpoint(base)[len("ipc://"):]
    ctx = zmq.Context()
    live = ctx.socket(zmq.ROUTER)
    try:
        live.bind(f"ipc://{path}")
        inode = os.stat(path).st_ino
        assert main(["router", "--port", "0", "--zmq-endpoint-base", base]) == 2
        assert "--zmq-endpoint-base: another process (a running router?) listens on" in one_line_error(capsys)
        assert os.stat(path).st_ino == inode  # the live router's file, still there
    finally:
        live.close(linger=0)
        ctx.term()


def test_tandem_up_says_it_before_starting_a_worker(capsys, busy_port, tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("llama")
    capsys.readouterr()  # (building the checkpoint reports its progress)
    assert main(["up", "--model", checkpoint, "--port", str(busy_port), "--log-dir", str(tmp_path / "logs")]) == 2
    assert f"--port {busy_port}: cannot listen" in one_line_error(capsys)
    assert not list((tmp_path / "logs").glob("*.log"))  # no process was started


@pytest.mark.parametrize("flags, message", [
    (["--colocated", "-2"], "--colocated: a number of workers is >= 0 (got -2)"),
    (["--prefill", "-1"], "--prefill: a number of workers is >= 0 (got -1)"),
    (["--port", "0"], "--port: tandem up needs a fixed port"),
    (["--ready-timeout", "-5"], "--ready-timeout: must be > 0 (got -5)"),
])
def test_tandem_up_refuses_a_negative_worker_count_or_port_0_before_starting_anything(capsys, tmp_path, flags,
                                                                                      message):
    """Both used to start: a negative count as none (or no worker at all, waiting out --ready-timeout), port 0 as a
    router on a port the launcher never polled."""
    assert main(["up", *flags, "--log-dir", str(tmp_path / "logs")]) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "logs").exists()


def test_a_file_that_cannot_be_written_is_one_line(capsys, tmp_path):
    existing = tmp_path / "afile"
    existing.write_text("x")
    assert main(["keygen", "--out", str(existing)]) == 2
    assert str(existing) in one_line_error(capsys)


def test_a_log_dir_that_cannot_be_made_names_the_flag_and_leaves_nothing(capsys, tiny_checkpoint, tmp_path,
                                                                         monkeypatch):
    checkpoint = tiny_checkpoint("llama")
    capsys.readouterr()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the cluster's work directory is made
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["up", "--model", checkpoint, "--port", str(free_port()), "--log-dir", str(blocker / "logs")]) == 2
    assert f"--log-dir {blocker / 'logs'}: cannot be created" in one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_tandem_up_takes_the_api_key_from_the_environment_as_tandem_router_does(monkeypatch):
    """Its router inherited $TANDEM_API_KEY and enforced it while `tandem up --help` said "default: no key"."""
    from deploy.cli import build_parser

    monkeypatch.setenv("TANDEM_API_KEY", "k1,k2")
    for command in ("up", "router"):
        assert build_parser().parse_args([command]).api_key == "k1,k2"
    assert "(default: $TANDEM_API_KEY)" in " ".join(build_parser()._subparsers._group_actions[0].choices["up"]
                                                   .format_help().split())
