import pytest

from pipeline.config import ConfigError, PipelineConfig, PipelineRole, build_config, env_overrides


def test_defaults_follow_max_names():
    config = PipelineConfig()
    assert config.pipeline_role is PipelineRole.PrefillAndDecode
    assert config.zmq_endpoint_base.startswith("ipc://")
    assert config.kv_cache.enable_prefix_caching


def test_yaml_section_env_and_overrides_in_precedence_order(tmp_path):
    path = tmp_path / "tandem.yaml"
    path.write_text(
        "prefill:\n  pipeline_role: PrefillOnly\n  max_batch_size: 4\n  kv_cache:\n    page_size: 8\n"
        "decode:\n  pipeline_role: DecodeOnly\n"
    )
    env = {"TANDEM_MAX_BATCH_SIZE": "6", "TANDEM_KV_CACHE__NUM_BLOCKS": "128", "TANDEM_HOME": "/x"}
    config = PipelineConfig.load(path, "prefill", overrides={"max_batch_input_tokens": 99}, environ=env)
    assert config.pipeline_role is PipelineRole.PrefillOnly
    assert config.max_batch_size == 6  # env beats file
    assert config.kv_cache.page_size == 8 and config.kv_cache.num_blocks == 128
    assert config.max_batch_input_tokens == 99
    assert config.section_name == "prefill"
    overridden = PipelineConfig.load(path, "prefill", overrides={"max_batch_size": 2}, environ=env)
    assert overridden.max_batch_size == 2  # explicit overrides beat env


def test_toml_file(tmp_path):
    path = tmp_path / "tandem.toml"
    path.write_text('[decode]\npipeline_role = "DecodeOnly"\n[decode.kv_cache]\npage_size = 32\n')
    config = PipelineConfig.load(path, "decode", environ={})
    assert config.pipeline_role is PipelineRole.DecodeOnly and config.kv_cache.page_size == 32


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"max_batch_size": 0}, "max_batch_size: Input should be greater than or equal to 1 (got 0)"),
        ({"kvcache_ce_watermark": 1.5}, "kvcache_ce_watermark: Input should be less than or equal to 1"),
        ({"pipeline_role": "Both"}, "pipeline_role: Input should be 'PrefillAndDecode', 'PrefillOnly' or 'DecodeOnly'"),
        ({"kv_cache": {"page_size": -1}}, "kv_cache.page_size: Input should be greater than or equal to 1"),
        ({"max_batch_sise": 3}, "max_batch_sise: unknown field; known fields here:"),
        ({"kv_cache": {"pages": 3}}, "kv_cache.pages: unknown field; known fields here: cpu_kv_cache_gib"),
        ({"kernel_backend": "cuda"}, "kernel_backend: Input should be 'torch', 'cpu', 'triton' or 'auto'"),
        ({"otlp_traces_endpoint": "localhost:4318"},  # the input once (a message naming it is not given it again)
         "otlp_traces_endpoint: must be an http:// or https:// URL (OTLP over HTTP; got 'localhost:4318')"),
        ({"router": {"request_timeout_s": float("inf")}}, "router.request_timeout_s: Input should be a finite number"),
        ({"drain_timeout_s": float("nan")}, "drain_timeout_s: Input should be a finite number"),
    ],
)
def test_invalid_values_name_the_field_and_range(data, expected):
    with pytest.raises(ConfigError) as info:
        build_config(data)
    assert expected in str(info.value) and str(info.value).count("got ") <= 1


def test_missing_file_and_section_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="config_file: no such file"):
        PipelineConfig.load(tmp_path / "nope.yaml", environ={})
    path = tmp_path / "c.yaml"
    path.write_text("a: {}\n")
    with pytest.raises(ConfigError, match="section_name: 'b' not found .* sections: a"):
        PipelineConfig.load(path, "b", environ={})
    path.write_text("a: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        PipelineConfig.load(path, "a", environ={})


def test_env_parsing_types_and_ignores_unknown_variables():
    env = {"TANDEM_ENABLE_CHUNKED_PREFILL": "false", "TANDEM_ZMQ_ENDPOINT_BASE": "tcp://127.0.0.1:5555",
           "TANDEM_HOME": "/tmp", "TANDEM_KV_CACHE__NOPE": "1", "OTHER": "1"}
    assert env_overrides(env) == {"enable_chunked_prefill": False, "zmq_endpoint_base": "tcp://127.0.0.1:5555"}
    with pytest.raises(ConfigError, match="max_batch_size"):
        PipelineConfig.load(environ={"TANDEM_MAX_BATCH_SIZE": "lots"})


def test_configuration_page_is_current():
    from pathlib import Path

    from deploy.config_docs import render

    page = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert page.read_text() == render(), "regenerate: python -m deploy.config_docs > docs/configuration.md"


def test_speculative_sections_from_file_env_and_flags(tmp_path):
    from deploy.cli import build_parser
    from deploy.config_flags import config_overrides

    path = tmp_path / "tandem.yaml"
    path.write_text("decode:\n  draft_model:\n    model_path: /ckpt/draft\n  speculative:\n    num_speculative_tokens: 2\n")
    config = PipelineConfig.load(path, "decode", environ={"TANDEM_SPECULATIVE__NUM_SPECULATIVE_TOKENS": "4"})
    assert config.draft_model.model_path == "/ckpt/draft" and config.speculative.num_speculative_tokens == 4
    assert config.is_speculative and not PipelineConfig().is_speculative
    with pytest.raises(ConfigError, match="speculative.num_speculative_tokens"):
        build_config({"speculative": {"num_speculative_tokens": 8}, "max_batch_input_tokens": 8})
    args = build_parser().parse_args(["worker", "--role", "DecodeOnly", "--draft-model-model-path", "/d",
                                      "--speculative-num-speculative-tokens", "3"])
    assert config_overrides(args) == {"draft_model": {"model_path": "/d"}, "speculative": {"num_speculative_tokens": 3}}


def test_served_model_name_flag_and_router_cors_flags():
    from deploy.cli import build_parser
    from deploy.config_flags import config_overrides

    args = build_parser().parse_args(["router", "--served-model-name", "team-model,alias", "--router-cors-allowed-origins",
                                      "https://a.example"])
    overrides = config_overrides(args)
    assert overrides["model"] == {"served_model_name": "team-model,alias"}
    config = build_config(overrides)
    assert config.model.served_model_name == "team-model,alias"
    assert config.router.cors_allowed_origins == "https://a.example"


def test_override_flags_are_the_flags_that_set_those_overrides():
    from bench.serve_compare import TANDEM_CONFIGS
    from deploy.cli import build_parser
    from deploy.config_flags import config_overrides, override_flags

    for overrides in [*TANDEM_CONFIGS.values(),
                      {"model": {"model_path": "/ckpt", "served_model_name": "a,b", "dtype": "bfloat16"},
                       "max_batch_size": 8,
                       "kv_cache": {"page_size": 4}, "enable_chunked_prefill": False}]:
        args = build_parser().parse_args(["up", *override_flags(overrides)])
        assert config_overrides(args) == overrides
    assert override_flags({"model": {"seed": 3}}) == ["--model-seed", "3"]
    # vLLM's --dtype, on every command
    assert build_config(config_overrides(build_parser().parse_args(["prefill", "--dtype", "bfloat16"]))).model.dtype \
        == "bfloat16"


def test_a_text_field_keeps_its_text_from_a_flag_or_variable():
    """A served name "2024", a path "123", a CORS origin "null": the text, not JSON's number or null (they used to
    be refused as not a string); other fields still parse (numbers, null, a section as an object)."""
    import argparse

    from deploy.config_flags import add_config_flags, config_overrides

    env = env_overrides({"TANDEM_MODEL__MODEL_PATH": "123", "TANDEM_ROUTER__CORS_ALLOWED_ORIGINS": "null",
                         "TANDEM_MAX_BATCH_SIZE": "8", "TANDEM_MAX_LENGTH": "null",
                         "TANDEM_KV_CACHE": '{"page_size": 4}'})
    assert env == {"model": {"model_path": "123"}, "router": {"cors_allowed_origins": "null"}, "max_batch_size": 8,
                   "max_length": None, "kv_cache": {"page_size": 4}}
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = config_overrides(parser.parse_args(["--served-model-name", "2024", "--bind-host", "10",
                                                "--max-batch-size", "3"]))
    assert flags == {"model": {"served_model_name": "2024"}, "bind_host": "10", "max_batch_size": 3}
    assert build_config(flags).model.served_model_name == "2024"


def test_every_model_field_has_a_flag_and_override_flags_round_trips():
    """model.device, model.seed and model.cpu_weight_prepack had no flag although the flags' help says every
    field has one (a launcher writing them out for a process raised instead)."""
    import argparse

    from deploy.config_flags import add_config_flags, config_overrides, override_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    wanted = {"model": {"device": "cpu", "seed": 3, "cpu_weight_prepack": False, "dtype": "float32"}}
    assert config_overrides(parser.parse_args(override_flags(wanted))) == wanted
    assert build_config(wanted).model.seed == 3
