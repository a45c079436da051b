"""What a local cluster keeps on disk besides its logs, and its removal: a private work dir (0700, from
``mkdtemp``) holding the config file every process reads, a generated cluster key for a ``tcp://`` cluster given
none, and by default the ``ipc://`` socket files. ``remove`` leaves only the logs: every socket file under the
cluster's ``ipc://`` base (a killed process's included, which it could not remove itself), the config file, the
key, and the work dir unless the logs are in it."""

from __future__ import annotations

import contextlib
import shutil
import stat
import tempfile
from pathlib import Path

import yaml

CONFIG_SECTION = "cluster"


class ClusterFiles:
    def __init__(self) -> None:
        self.work_dir = Path(tempfile.mkdtemp(prefix="tandem-"))  # owner-only

    @property
    def default_endpoint_base(self) -> str:
        return f"ipc://{self.work_dir}/zmq"

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
        with contextlib.suppress(OSError):  # not empty: the logs are here, for the user
            self.work_dir.rmdir()
