"""``--otlp-traces-endpoint`` (vLLM's flag) on every command that starts a process, and in the config both
launchers hand their processes (the local launcher's path is exercised by tests/cluster/test_tracing.py)."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser
from deploy.config_flags import config_from_args
from deploy.ray_cmd import _up_options

URL = "http://collector.example:4318"


@pytest.mark.parametrize("argv", [["router"], ["prefill"], ["decode"], ["worker", "--role", "PrefillAndDecode"],
                                  ["up"]])
def test_every_process_command_takes_the_flag(argv):
    args = build_parser().parse_args([*argv, "--otlp-traces-endpoint", URL])
    assert config_from_args(args).otlp_traces_endpoint == URL
    assert config_from_args(build_parser().parse_args(argv)).otlp_traces_endpoint is None  # off by default


def test_a_ray_deployment_hands_the_endpoint_to_its_processes():
    args = build_parser().parse_args(["ray", "up", "--otlp-traces-endpoint", URL])
    assert _up_options(args).config["otlp_traces_endpoint"] == URL


def test_an_endpoint_that_is_not_an_http_url_is_an_error_naming_the_field():
    args = build_parser().parse_args(["router", "--otlp-traces-endpoint", "collector:4317"])
    with pytest.raises(Exception, match="otlp_traces_endpoint"):
        config_from_args(args)
