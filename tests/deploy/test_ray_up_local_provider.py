"""`ray up` with deploy/ray/cluster-local.yaml end to end, with this machine as the cluster (slow).

The test runs an sshd of its own on loopback and points a copy of the cluster file at it (head
127.0.0.1, no workers, `nc` as ssh proxy for the free port), so `ray up`, `ray exec` and `ray down`
run exactly as against a remote machine: ssh, rsync of the bootstrap files, Ray's start commands.
Then `tandem ray up` runs through `ray exec`, one completion is served, and everything goes down.

Nothing may reach anyone else's Ray or files on this shared machine:
- the ssh sessions get HOME and TMPDIR in the test's directory (sshd `SetEnv`), so Ray's bootstrap
  files (~/ray_bootstrap_*) and the local provider's state (TMPDIR/ray/cluster-NAME.state) land there;
  the `ray` CLI here gets the same TMPDIR, for its config cache;
- `ray down` runs a bare `ray stop` on the head, which stops every Ray on the machine. PATH can't be
  set through sshd (Ray's `bash --login` lets /etc/profile reset it), but the sessions' ~/.bashrc is
  ours: it puts a `ray` shim first whose `stop` stops, by pid, only this test's Ray (the processes
  naming its temp dir or its GCS address, and their descendants: Tandem's processes);
- Ray runs on loopback, on free ports, in a private temp dir; leftovers are stopped by pid.

Run it with `.venv/bin/pytest -m slow tests/deploy/test_ray_up_local_provider.py` (about 30 s).
"""

from __future__ import annotations

import getpass
import hashlib
import inspect
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")
import yaml  # noqa: E402

from tests.cluster.conftest import free_port  # noqa: E402
from tests.deploy.conftest import children_of  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.skipif(
    not all(shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin") for tool in ("sshd", "nc", "rsync")),
    reason="needs sshd, nc and rsync: apt-get install openssh-server netcat-openbsd rsync")]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # the venv's ray and tandem, also "on the head"
RAY_PORT_FLAGS = ["ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                  "runtime-env-agent-port", "node-manager-port", "object-manager-port", "metrics-export-port"]


def stop_processes_of(*markers: str, grace_s: float = 15.0) -> list[int]:
    """Stop, by pid, every process whose command line (words joined by spaces) holds one of ``markers``,
    and their descendants; -> their pids.

    SIGTERM, then SIGKILL for what outlives ``grace_s``, in `ray stop`'s order: raylets first, GCS
    servers last (Ray's monitors wait for a GCS that is gone until they are killed). The shim's
    `ray stop` runs a copy of this source, hence the imports inside.
    """
    import os
    import signal
    import time
    from pathlib import Path

    def stat(pid):  # (state, parent pid), None once it's gone
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return fields[0], int(fields[1])
        except (OSError, IndexError, ValueError):
            return None

    def cmdline(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return b""

    def terminate(pids):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while pids and time.monotonic() < deadline:
                pids = {pid for pid in pids if (s := stat(pid)) and s[0] != "Z"}
                time.sleep(0.1)

    parents = {int(p.name): s[1] for p in Path("/proc").iterdir() if p.name.isdigit() and (s := stat(p.name))}
    found = {pid for pid in parents if any(marker.encode() in cmdline(pid) for marker in markers)}
    while children := {pid for pid, parent in parents.items() if parent in found} - found:
        found |= children
    found -= {os.getpid(), os.getppid()}
    program = {pid: cmdline(pid).split(b" ")[0] for pid in found}
    raylets = {pid for pid in found if program[pid].endswith(b"/raylet")}
    gcs_servers = {pid for pid in found if program[pid].endswith(b"/gcs_server")}
    for wave in (raylets, found - raylets - gcs_servers, gcs_servers):
        terminate(wave)
    return sorted(found)


SHIM = '''#!{python}
"""`ray` first on PATH in the test's ssh sessions: `ray stop` stops only the test's Ray, by pid."""
import os
import sys

{stop_source}

if sys.argv[1:2] == ["stop"]:
    with open({log!r}, "a") as log:
        log.write(f"ray stop: stopped {{stop_processes_of(*{markers!r})}}\\n")
    sys.exit(0)
os.execv({ray!r}, [{ray!r}, *sys.argv[1:]])
'''


def write_ssh_home(work: Path, ray_markers: list[str]) -> None:
    """HOME of the ssh sessions: a ~/.bashrc that puts the `ray` shim first on PATH."""
    shim = work / "shim" / "ray"
    shim.parent.mkdir()
    shim.write_text(SHIM.format(python=sys.executable, stop_source=inspect.getsource(stop_processes_of),
                                log=str(work / "shim.log"), markers=ray_markers, ray=str(VENV_BIN / "ray")))
    shim.chmod(0o755)
    (work / "home").mkdir()
    (work / "home" / ".bashrc").write_text(f'export PATH="{shim.parent}:$PATH"\n')  # silent: rsync reads stdout


def start_sshd(work: Path, port: int) -> tuple[subprocess.Popen, Path]:
    """sshd -D on 127.0.0.1:``port``, from WORK/ssh, letting in root with a key made here; -> (sshd, key)."""
    ssh = work / "ssh"
    ssh.mkdir()
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / key)], check=True)
    shutil.copy(ssh / "user_key.pub", ssh / "authorized_keys")
    config = ssh / "sshd_config"
    config.write_text(f"""ListenAddress 127.0.0.1
Port {port}
HostKey {ssh / "host_key"}
AuthorizedKeysFile {ssh / "authorized_keys"}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {ssh / "sshd.pid"}
SetEnv HOME={work / "home"} TMPDIR={work / "tmp"} RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
""")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory, normally made by its service
    with open(ssh / "sshd.log", "w") as log:
        sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return sshd, ssh / "user_key"
        except OSError:
            assert sshd.poll() is None and time.monotonic() < deadline, (ssh / "sshd.log").read_text()
            time.sleep(0.1)


def head_start_command(ray_temp_dir: Path, gcs_port: int) -> str:
    """`ray start --head` on loopback only, every port free, in a private temp dir (no `ray stop` first)."""
    env = f"export AUTOSCALER_METRIC_PORT={free_port()} DASHBOARD_METRIC_PORT={free_port()}; "
    ports = " ".join(f"--{flag}={free_port()}" for flag in RAY_PORT_FLAGS)
    return (f"{env}{VENV_BIN / 'ray'} start --head --node-ip-address=127.0.0.1 --port={gcs_port} {ports} "
            f"--include-dashboard=false --disable-usage-stats --temp-dir={ray_temp_dir} "
            f"--object-store-memory=100000000 --num-cpus=2 --autoscaling-config=~/ray_bootstrap_config.yaml")


def write_cluster_file(work: Path, name: str, sshd_port: int, user_key: Path, start_command: str) -> Path:
    """deploy/ray/cluster-local.yaml with this machine as the head and nothing fetched from the network."""
    config = yaml.safe_load((REPO / "deploy" / "ray" / "cluster-local.yaml").read_text())
    config["cluster_name"] = name
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(user_key),
                      "ssh_proxy_command": f"nc 127.0.0.1 {sshd_port}"}
    config.update(file_mounts={}, setup_commands=[], head_start_ray_commands=[start_command])
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ray_cli(args: list[str], work: Path, timeout_s: float = 300) -> str:
    """The `ray` cluster launcher CLI as a user runs it; its config cache goes to the test's TMPDIR."""
    env = {**os.environ, "TMPDIR": str(work / "tmp"), "RAY_USAGE_STATS_ENABLED": "0"}
    started = time.monotonic()
    done = subprocess.run([str(VENV_BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    print(f"{time.monotonic() - started:5.1f} s  ray {' '.join(args)}")  # shown with pytest -s
    assert done.returncode == 0, f"ray {' '.join(args)} exited {done.returncode}:\n{output}"
    return output


def ssh_control_dir(cluster_name: str) -> Path:
    """Where the launcher keeps a cluster's ssh ControlMaster sockets (Ray's own naming: not under TMPDIR)."""
    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    return Path(f"/tmp/ray_ssh_{user}") / hashlib.sha256(cluster_name.encode()).hexdigest()[:10]


def test_ray_up_tandem_ray_up_one_completion_and_down():
    started = time.monotonic()
    name = f"tandem-test-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix="tru-", dir="/tmp"))  # short: Ray's socket paths live under it
    (work / "tmp").mkdir()
    gcs = f"127.0.0.1:{free_port()}"
    # Ray's processes name its temp dir, except its client server, a child of `ray start` (gone once
    # Ray is up) that only names the GCS address.
    ray_markers = [str(work / "r"), f"={gcs}"]
    control_dir = ssh_control_dir(name)
    control_parent_existed = control_dir.parent.exists()
    home_files = [Path.home() / f for f in ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem")]
    home_files_before = {path for path in home_files if path.exists()}
    sshd_port, sshd = free_port(), None
    try:
        write_ssh_home(work, ray_markers)
        sshd, user_key = start_sshd(work, sshd_port)
        cluster = str(write_cluster_file(work, name, sshd_port, user_key,
                                         head_start_command(work / "r", int(gcs.rsplit(":", 1)[1]))))

        ray_cli(["up", "-y", "--no-config-cache", cluster], work)
        assert (work / "home" / "ray_bootstrap_config.yaml").exists()  # rsynced to the head's HOME
        assert (work / "tmp" / "ray" / f"cluster-{name}.state").exists()  # the local provider's state
        status = ray_cli(["exec", cluster, f"{VENV_BIN / 'ray'} status --address {gcs}"], work)
        assert "Active:" in status and "CPU" in status, status

        serve_one_completion(cluster, gcs, work)

        ray_cli(["down", "-y", cluster], work)
        assert "ray stop: stopped [" in (work / "shim.log").read_text()  # the shim's, not a bare `ray stop`
        assert not pids_holding(ray_markers), "ray down left Ray running"
        assert {path for path in home_files if path.exists()} == home_files_before, "ray up wrote to ~"
        print(f"ray up .. ray down: {time.monotonic() - started:.0f} s")
    finally:
        stop_processes_of(*ray_markers)
        stop_ssh(work, sshd_port, sshd)
        shutil.rmtree(control_dir, ignore_errors=True)
        if not control_parent_existed:
            shutil.rmtree(control_dir.parent, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def stop_ssh(work: Path, sshd_port: int, sshd: subprocess.Popen | None) -> None:
    """The launcher's ssh ControlMasters and their `nc` proxies first, then sshd once its sessions ended.

    In that order sshd reaps its sessions; killed together they become orphans, and PID 1 on these
    machines reaps nothing, so they would stay as zombies.
    """
    stop_processes_of(str(work / "ssh" / "user_key"), f"nc 127.0.0.1 {sshd_port}", grace_s=5)
    deadline = time.monotonic() + 5
    while sshd is not None and children_of(sshd.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    stop_processes_of(str(work / "ssh"), grace_s=5)  # sshd and whatever it still runs
    if sshd is not None:
        sshd.wait(5)


def serve_one_completion(cluster: str, gcs: str, work: Path) -> None:
    """`tandem ray up` on the head through `ray exec`, one completion from the URL it prints, `tandem ray down`."""
    tandem = VENV_BIN / "tandem"
    logs = work / "tandem-logs"
    up = ray_cli(["exec", cluster, f"{tandem} ray up --address {gcs} --prefill 1 --decode 1 "
                  f"--port {free_port()} --zmq-port {free_port()} --log-dir {logs}"], work, timeout_s=400)
    try:
        ready = re.search(r"ready at (http://\S+)/v1", up)
        assert ready, f"tandem ray up printed no URL:\n{up}"
        from openai import OpenAI

        client = OpenAI(base_url=f"{ready.group(1)}/v1", api_key="unused", timeout=120)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                               temperature=0)
        assert completion.choices[0].text, completion
        assert completion.usage.completion_tokens == 8, completion.usage  # random weights: no early EOS
    finally:
        ray_cli(["exec", cluster, f"{tandem} ray down --address {gcs}"], work)


def pids_holding(markers: list[str]) -> list[int]:
    """Processes (not zombies) whose command line holds one of ``markers``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if any(marker.encode() in cmdline for marker in markers) and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found
