"""What a local cluster keeps on disk besides its logs, and its removal: a private work dir (0700, from
``mkdtemp``, named after the launcher's pid) holding the config file every process reads, a generated cluster key
for a ``tcp://`` cluster given none, the processes' signs of life (``watchdog_dir``: ``deploy.watchdog``) and by
default the ``ipc://`` socket files. ``remove`` leaves only the logs: every socket file under the cluster's
``ipc://`` base (a killed process's included, which it could not remove itself), the config file, the key, the
signs of life, and the work dir unless the logs are in it. A launcher killed by SIGKILL
removes nothing; the next one on the host removes what it left (``remove_stale_work_dirs``), logs kept."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import yaml

from kv_transfer.shm_files import is_running

CONFIG_SECTION = "cluster"


log = logging.getLogger(__name__)
WORK_DIR_PREFIX = "tandem-"


class ClusterFiles:
    def __init__(self, work_dir: Path | None = None) -> None:
        """A new work dir (after clearing killed launchers' ones), or ``work_dir``, one that exists."""
        if work_dir is None:
            remove_stale_work_dirs()
            work_dir = Path(tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{os.getpid()}-"))  # owner-only
        self.work_dir = work_dir

    @property
    def default_endpoint_base(self) -> str:
        return f"ipc://{self.work_dir}/zmq"

    @property
    def watchdog_dir(self) -> Path:
        return self.work_dir / "alive"

    @property
    def default_log_dir(self) -> Path:
        return self.work_dir / "logs"

    def add_cluster_key(self, config: dict) -> None:
        """A ``tcp://`` cluster given no key (and not told ``insecure_cluster``) gets a fresh one here, owner-only,
        named in ``config`` so every process reads it (docs/security.md)."""
        security = config.get("security") or {}
        if (not str(config["zmq_endpoint_base"]).startswith("tcp://") or security.get("cluster_key_file")
                or security.get("insecure_cluster")):
            return
        from pipeline.security import generate_cluster_key

        key_file = generate_cluster_key(self.work_dir / "cluster-key")
        config["security"] = {**security, "cluster_key_file": str(key_file)}

    def write_config(self, config: dict) -> list[str]:
        """Write ``config`` for every process; the ``--config`` / ``--section`` arguments that read it."""
        path = self.work_dir / "cluster.yaml"
        path.write_text(yaml.safe_dump({CONFIG_SECTION: config}))
        return ["--config", str(path), "--section", CONFIG_SECTION]

    def remove(self, endpoint_base: str) -> None:
        """Everything but the logs (see the module docstring); idempotent."""
        if endpoint_base.startswith("ipc://"):
            base_path = Path(endpoint_base[len("ipc://"):])
            for leftover in base_path.parent.glob(base_path.name + "-*"):
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(leftover.lstat().st_mode):
                        leftover.unlink()
        (self.work_dir / "cluster.yaml").unlink(missing_ok=True)
        shutil.rmtree(self.work_dir / "cluster-key", ignore_errors=True)
        shutil.rmtree(self.watchdog_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # not empty: the logs are here, for the user
            self.work_dir.rmdir()


def remove_stale_work_dirs(root: str | None = None) -> list[Path]:
    """Clear the work dirs (under ``root``, default the temp dir) of launchers that no longer run, as their
    ``remove`` would have (their own ``ipc://`` sockets, config, key; the logs stay); only this user's. Returns
    the dirs cleared."""
    cleared = []
    for work_dir in Path(root or tempfile.gettempdir()).glob(f"{WORK_DIR_PREFIX}*-*"):
        pid_text = work_dir.name[len(WORK_DIR_PREFIX):].split("-", 1)[0]
        try:
            if (not pid_text.isdigit() or is_running(int(pid_text)) or not work_dir.is_dir()
                    or work_dir.stat().st_uid != os.getuid()):
                continue
        except OSError:  # gone meanwhile: another launcher cleared it
            continue
        ClusterFiles(work_dir).remove(f"ipc://{work_dir}/zmq")
        log.info("removed what a killed tandem up (pid %s) left in %s%s", pid_text, work_dir,
                 " (its logs stay)" if work_dir.exists() else "")
        cleared.append(work_dir)
    return cleared
