"""The `ray up` cluster files in deploy/ray/ pass Ray's own checks and say what Tandem needs.

Ray's checks are the ones `ray up` runs before it touches a machine: `prepare_config` fills the
provider's defaults, `validate_config` checks the result against Ray's JSON schema. Neither needs
network or cloud credentials; the provider's bootstrap (boto3 for AWS) is never called here.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("ray")
import jsonschema  # noqa: E402  (ray[default] brings it)
import yaml  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CLUSTER_FILES = ["cluster-local.yaml", "cluster-aws.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((REPO / "deploy" / "ray" / name).read_text())


def checked(config: dict) -> dict:
    """What `ray up` would go on with: defaults filled, schema and cross-field checks passed."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_file_passes_rays_checks_and_installs_tandem(name):
    config = checked(load(name))
    assert config["cluster_name"] == "tandem"
    assert config["file_mounts"] == {"~/tandem": "."}  # the checkout, since no index has Tandem
    extras = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    assert re.search(r"^ray\s*=", extras, re.M), "the setup commands install tandem[ray]: pyproject.toml lacks it"
    for node_setup in ("head_setup_commands", "worker_setup_commands"):
        assert any('"$HOME/tandem[ray]"' in command for command in config[node_setup]), node_setup


def test_local_file_names_its_machines():
    provider = checked(load("cluster-local.yaml"))["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] == "YOUR_HEAD_IP" and provider["worker_ips"] == []


@pytest.mark.parametrize(("address", "resources"), [
    ("10.0.0.11", {"prefill": 1}), ("10.0.0.12", {"decode": 1}), ("10.0.0.99", {}),
])
def test_local_worker_node_picks_its_role_by_address(address, resources):
    """The one worker start command, run with `ray` and `hostname` stubbed: what each node passes."""
    command = load("cluster-local.yaml")["worker_start_ray_commands"][-1]
    stubs = f'ray() {{ printf "%s\\n" "$@"; }}; hostname() {{ echo "192.168.0.5 {address}"; }}; RAY_HEAD_IP=10.0.0.1;'
    argv = subprocess.run(["bash", "-c", stubs + command], capture_output=True, text=True, check=True).stdout
    assert argv.splitlines()[:2] == ["start", "--address=10.0.0.1:6379"]
    assert json.loads(argv.splitlines()[2].removeprefix("--resources=")) == resources


def test_aws_node_types_carry_the_role_resources_tandem_asks_for():
    text = (REPO / "deploy" / "ray" / "cluster-aws.yaml").read_text()
    config = checked(yaml.safe_load(text))
    node_types = config["available_node_types"]
    head = node_types[config["head_node_type"]]
    assert "GPU" not in head["resources"] and not {"prefill", "decode"} & set(head["resources"])
    # The `tandem ray up` line the file's header shows asks for exactly these resources.
    for role in ("prefill", "decode"):
        asked = re.search(rf"--{role}-resources '(\{{.*?\}})'", text).group(1)
        assert json.loads(asked.replace('\\"', '"')) == {role: 1}
        node = node_types[f"{role}_gpu"]
        assert node["resources"] == {"GPU": 1, role: 1}
        assert 1 <= node["min_workers"] <= node["max_workers"]
        assert node["node_config"]["InstanceType"].startswith(("g5.", "g6."))
        assert node["node_config"]["ImageId"] == "YOUR_AMI_ID"  # Ray's default AMI is too old
    assert "boto3" in " ".join(config["head_setup_commands"])  # the head's autoscaler launches nodes


@pytest.mark.parametrize(("breakage", "error"), [
    (lambda c: c["available_node_types"]["prefill_gpu"].update(resources="GPU=1"), jsonschema.ValidationError),
    (lambda c: c.update(head_start_commands=["ray start --head"]), jsonschema.ValidationError),  # a typo
    (lambda c: c.update(max_workers=1), ValueError),  # fewer than the node types' min_workers together
    (lambda c: c.update(head_node_type="gpu"), ValueError),
])
def test_a_broken_copy_is_rejected(breakage, error):
    """The checks above would catch a broken file: Ray refuses these edits of the AWS file."""
    config = load("cluster-aws.yaml")
    breakage(config)
    with pytest.raises(error):
        checked(config)
