"""PipelineConfig: the one source of truth for how a Tandem process runs.

Field names follow Modular MAX's ``max.pipelines.lib.config.PipelineConfig``. A config is built from
(lowest to highest precedence) defaults, a YAML/TOML file section, ``TANDEM_*`` environment variables
and explicit overrides (CLI flags or keyword arguments). Any invalid value raises ``ConfigError``
naming the field and what it accepts.
"""

from __future__ import annotations

import enum
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "TANDEM_"
ENV_NESTED_DELIMITER = "__"


class ConfigError(ValueError):
    """A configuration value, file or section is invalid; the message names the field."""


class PipelineRole(str, enum.Enum):
    PrefillAndDecode = "PrefillAndDecode"
    PrefillOnly = "PrefillOnly"
    DecodeOnly = "DecodeOnly"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which checkpoint to load and where to run it."""

    model_path: str | None = Field(None, description="Hugging Face checkpoint directory; None = built-in model")
    served_model_name: str | None = Field(
        None, description="the names the API serves the model under, comma-separated (the first is the one "
        "responses and /v1/models give first); None = the checkpoint folder's name")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="weights and KV cache dtype; auto = float32 on CPU, bfloat16 on GPU")
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:N' or 'auto'")
    seed: int = Field(0, ge=0, description="seed of the global generator (unseeded requests)")
    cpu_weight_prepack: bool = Field(
        True, description="CPU: keep a copy of every linear weight packed for oneDNN, used for batches of 2-256 "
        "rows, where it is faster than the checkpoint layout (doubles the weights' memory)")
    quantization: Literal["int8"] | None = Field(
        None, description="quantize a float checkpoint's linear layers at load (vLLM's --quantization): int8 = W8A8, "
        "int8 weights per output channel and int8 activations per token (docs/models.md); None = as the checkpoint "
        "is (a quantized checkpoint runs quantized either way)")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"


class DraftModelConfig(_Section):
    """The draft model of speculative decoding (MAX's ``draft_model``); it runs in the target's dtype and device."""

    model_path: str | None = Field(
        None, description="the draft's Hugging Face checkpoint directory (any supported architecture, the target's "
        "tokenizer); None = the target itself")


class SpeculativeConfig(_Section):
    """Speculative decoding: the draft proposes tokens, one target forward checks them all (docs/speculative.md)."""

    num_speculative_tokens: int = Field(
        0, ge=0, le=16, description="tokens the draft model proposes per step (K, vLLM's name); 0 = off")


class KVCacheConfig(_Section):
    """The paged KV cache: block size and how many blocks to allocate."""

    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=2, description="blocks in the pool; None = from memory fraction")
    device_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="fraction of free device memory for KV when num_blocks is None"
    )
    cpu_kv_cache_gib: float = Field(1.0, gt=0.0, description="KV pool size on CPU when num_blocks is None")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prompt prefixes")
    warmup_chunk_tokens: int = Field(
        32, ge=1, description="a prefix warm-up (a prefill worker computing a finished turn's answer into its prefix "
        "cache, router.warm_prefill_cache) runs only in steps with nothing else to do, at most this many tokens a "
        "step: a request that arrives meanwhile waits for one such chunk at most")


class SamplingConfig(_Section):
    """Defaults applied to requests that leave a parameter unset."""

    temperature: float = Field(1.0, ge=0.0, description="default temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="default nucleus threshold")
    top_k: int = Field(-1, ge=-1, description="default top-k (-1 = off)")
    max_tokens: int = Field(
        256, ge=1, description="default output length of the offline API; the HTTP API's default is the rest of "
        "the context (as vLLM's and OpenAI's) unless this is set explicitly or the checkpoint's "
        "generation_config.json sets max_new_tokens")
    structured_output_backend: Literal["llguidance", "xgrammar"] = Field(
        "llguidance", description="grammar backend of structured output requests that name none")
    generation_config: Literal["auto", "ignore"] = Field(
        "auto", description="auto: the checkpoint's generation_config.json sampling defaults (temperature, top_p, "
        "top_k, min_p, repetition_penalty, max_new_tokens) fill what a request leaves unset, below values set in "
        "this section; ignore: only this section (its EOS ids end generation either way)")


class TransferConfig(_Section):
    """How KV moves from prefill to decode workers, and how long a decode worker waits for it."""

    transport: Literal["auto", "zmq", "shm"] = Field("auto", description="auto: shared memory on one host, else ZMQ")
    ttl_s: float = Field(30.0, gt=0.0, description="a reservation expires if its KV has not arrived by then")
    heartbeat_interval_s: float = Field(0.5, gt=0.0, description="worker -> router heartbeat period")
    kv_migration_on_drain: bool = Field(
        True, description="a draining DecodeOnly worker hands its running streams, with their KV, to another "
        "DecodeOnly worker the router picks (nothing recomputed; docs/migration.md); false = they finish where "
        "they are within drain_timeout_s")


class RouterConfig(_Section):
    """How the router decides who is alive, what to admit and where to prefill."""

    dead_after_s: float = Field(
        3.0, gt=0.0, description="a worker silent this long is dead (heartbeats come from a thread no step blocks)")
    max_queued_requests: int = Field(
        256, ge=0, description="requests that wait in the router while every worker is saturated; beyond: 429")
    queue_timeout_s: float = Field(
        60.0, gt=0.0, description="a request that waited this long for a free worker gets 429")
    max_local_prefill_length: int = Field(
        32, ge=0, description="DecodeOnly workers prefill prompts up to this many tokens themselves (0 = never); see docs/load.md")
    request_timeout_s: float = Field(600.0, gt=0.0, description="a request unfinished after this gets 504")
    cors_allowed_origins: str = Field(
        "*", description="browser origins allowed to call the API (CORS), comma-separated; \"*\" = any (vLLM's "
        "default), empty = no CORS headers")
    cors_allow_credentials: bool = Field(False, description="CORS: let browsers send cookies and auth headers")
    http_keep_alive_s: float = Field(
        75.0, gt=0.0, description="an idle HTTP keep-alive connection stays open this long: longer than the idle "
        "timeouts of the clients and load balancers in front (httpx and the openai SDK 5 s, AWS ALB 60 s), so a "
        "client never sends a request on a connection the router is closing at that moment")
    kv_aware_routing: bool = Field(
        True, description="route each request to the workers whose prefix caches hold most of its prompt, weighed "
        "against their load (workers report their cached blocks; docs/kv-routing.md); false = by load alone")
    kv_overlap_weight: float = Field(
        16.0, ge=0.0, description="KV-aware routing: the cost of one prompt block a worker must compute or receive, "
        "against one block its running requests hold (Dynamo's overlap weight; 16 keeps a conversation where its "
        "KV is unless the other worker is lighter by about a dozen requests, docs/kv-routing.md)")
    warm_prefill_cache: bool = Field(
        True, description="when a disaggregated request ends, its prefill worker computes the KV of prompt + "
        "answer into its prefix cache in idle steps, so a conversation's next turn there computes only the new "
        "message; and prefill workers lacking a prefix conversations share (a system prompt) warm it up "
        "(docs/kv-routing.md); false = neither")
    early_prefill: bool = Field(
        True, description="a disaggregated request's prompt goes to its prefill worker at once, beside the request "
        "to its decode worker, so the prefill starts before the decode worker has reserved blocks and asked for it "
        "(the decode worker's request then claims it; docs/kv-routing.md); false = the prefill starts when asked")
    max_migrations: int = Field(
        3, ge=0, description="a stream whose worker dies after its first token moves to another worker, which "
        "recomputes its prompt and the tokens sent so far and goes on (docs/load.md); at most this often, then it "
        "fails; 0 = never (n > 1 requests never move)")
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral", "harmony", "deepseek_v3",
                              "deepseek_v31"] = Field(
        "auto", description="how tool calls are read from the model's text (docs/openai-api.md): hermes (Qwen, "
        "Hermes <tool_call>), llama3_json, mistral ([TOOL_CALLS]), harmony (gpt-oss), deepseek_v3 / deepseek_v31 "
        "(DeepSeek-V3 / -R1, and V3.1 on: <｜tool▁calls▁begin｜>); auto = inferred from the chat template; none = "
        "requests with tools get a 400 unless tool_choice is none")
    reasoning_parser: Literal["think", "qwen3", "deepseek_r1", "gpt_oss"] | None = Field(
        None, description="thinking models: <think>...</think> goes to reasoning_content, and constraints apply "
        "after it; gpt_oss: harmony's analysis channel is the reasoning, its final channel the content; None = the "
        "thinking stays in the content")


class SecurityConfig(_Section):
    """Cluster socket security (docs/security.md): CurveZMQ with one cluster key on every tcp:// socket."""

    cluster_key_file: str | None = Field(
        None, description="the cluster key (cluster.key_secret from `tandem keygen`); every process of a cluster "
        "needs the same one; tcp:// sockets then admit only peers that hold it and are encrypted")
    insecure_cluster: bool = Field(
        False, description="let a process with a tcp:// endpoint base and no cluster key start anyway (anyone "
        "who reaches its ports can then join the cluster, read prompts and write KV)")


class PipelineConfig(_Section):
    config_file: str | None = Field(None, description="YAML/TOML file this config was read from")
    section_name: str | None = Field(None, description="section of config_file")
    pipeline_role: PipelineRole = Field(
        PipelineRole.PrefillAndDecode, description="PrefillAndDecode (colocated), PrefillOnly or DecodeOnly")
    zmq_endpoint_base: str = Field("ipc:///tmp/tandem", description="every socket address derives from it")
    bind_host: str | None = Field(
        None, description="tcp bases: the address a worker binds its own sockets (prefill requests, KV) on, which "
        "peers on other hosts connect to; None = this machine's address on the route to the router")
    max_length: int | None = Field(None, ge=2, description="max prompt + output tokens; None = model's limit")
    max_batch_size: int = Field(64, ge=1, description="max requests in one decode batch")
    max_batch_input_tokens: int = Field(
        512, ge=1, description="max tokens per step (decodes first, then prefill chunks): bounds step time; see docs/load.md")
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps")
    long_prefill_token_threshold: int | None = Field(
        128, ge=1, description="while prompts wait, a prompt chunk takes at most this many tokens of a step, so short "
        "prompts are admitted beside a long one (the rest of the budget goes back to it); None = no cap")
    kvcache_ce_watermark: float = Field(
        0.95, gt=0.0, le=1.0, description="admit a prefill only while KV use stays under this fraction"
    )
    enable_overlap_scheduler: bool = Field(
        False, description="launch each engine step before reading the previous one's tokens, so the host "
        "schedules and prepares while the model computes (MAX's overlap scheduler; docs/overlap.md)")
    max_queue_size_tg: int | None = Field(None, ge=1, description="max requests waiting for admission")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: admit waiting requests in arrival order, preempt the latest admitted; "
        "priority (vLLM's): admit the best (priority, arrival) first, preempt the worst (highest priority value, "
        "latest arrival) first when KV runs out; a request's priority: lower is served first, default 0 (docs/load.md)")
    drain_timeout_s: float = Field(
        30.0, ge=0.0, description="on SIGTERM a router or worker stops admitting and gives in-flight requests this long")
    step_stall_timeout_s: float = Field(
        300.0, gt=0.0, description="a worker whose one engine step runs longer exits (its launcher restarts it)")
    kernel_backend: Literal["torch", "cpu", "triton", "auto"] = Field(
        "auto", description="auto = triton on CUDA, cpu (the native CPU kernels, torch references where they "
        "do not apply) on CPU; torch = the references alone (env: TANDEM_KERNEL_BACKEND)")
    cpu_cores: str | None = Field(
        None, description="CPU cores a worker (or the router) may run on, Linux list syntax '0-3,6' (as taskset -c); "
        "None = as started. tandem up: the pool it splits among its workers")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads of a worker; None = one per core it may use")
    tensor_parallel_size: int = Field(
        1, ge=1, description="rank processes one model is split across, Megatron-style (heads, MLP columns, vocab); "
        "1 = one process. The offline LLM and colocated (PrefillAndDecode) workers, dense Llama-family "
        "checkpoints (docs/tensor-parallel.md)")
    tensor_parallel_timeout_s: float = Field(
        60.0, gt=0.0, description="a tensor-parallel collective that waits longer than this for a rank (hung or gone) "
        "fails: the engine raises and a worker exits, so its launcher restarts it with all its ranks")
    otlp_traces_endpoint: str | None = Field(
        None, description="OpenTelemetry collector every process sends request traces to, OTLP over HTTP "
        "(http://host:4318 or its /v1/traces URL; vLLM's flag); None = no tracing (docs/observability.md)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    draft_model: DraftModelConfig = Field(default_factory=DraftModelConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @field_validator("zmq_endpoint_base")
    @classmethod
    def _check_endpoint_base(cls, value: str) -> str:
        from pipeline.endpoints import validate_endpoint_base

        return validate_endpoint_base(value)

    @field_validator("bind_host")
    @classmethod
    def _check_bind_host(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or value.strip("[]") in ("*", "0.0.0.0", "::")):
            raise ValueError(f"must be an address peers can connect to, not a wildcard or empty (got {value!r})")
        return value

    def resolved_bind_host(self) -> str | None:
        """``bind_host``, or this machine's address on the route to the router (tcp; None for ipc)."""
        from pipeline.endpoints import default_bind_host

        return self.bind_host or default_bind_host(self.zmq_endpoint_base)

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _check_otlp_traces_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL (OTLP over HTTP; got {value!r})")
        return value

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _check_cpu_cores(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # "--cpu-cores 3" and TANDEM_CPU_CORES=3 arrive parsed as numbers
        if not isinstance(value, str):
            return value  # None, or a type error pydantic reports
        from pipeline.core_list import format_core_list, parse_core_list

        return format_core_list(parse_core_list(value))

    @model_validator(mode="after")
    def _check_consistency(self) -> "PipelineConfig":
        if not self.enable_chunked_prefill and self.max_length is not None:
            if self.max_batch_input_tokens < self.max_length:
                raise ValueError(
                    "max_batch_input_tokens: must be >= max_length when enable_chunked_prefill is false "
                    f"(got {self.max_batch_input_tokens} < {self.max_length})"
                )
        if (error := tensor_parallel_role_error(self.pipeline_role, self.tensor_parallel_size, self.model.device,
                                                self.transfer.transport)) is not None:
            raise ValueError(error)
        if self.speculative.num_speculative_tokens and self.enable_overlap_scheduler:
            raise ValueError("speculative.num_speculative_tokens: speculative decoding does not run with "
                             "enable_overlap_scheduler yet; turn one of them off")
        if self.speculative.num_speculative_tokens >= self.max_batch_input_tokens:
            raise ValueError("speculative.num_speculative_tokens: must be < max_batch_input_tokens (a verify step "
                             f"runs K + 1 tokens per request; got {self.speculative.num_speculative_tokens} >= "
                             f"{self.max_batch_input_tokens})")
        return self

    @property
    def is_speculative(self) -> bool:
        return self.speculative.num_speculative_tokens > 0

    @classmethod
    def load(
        cls,
        config_file: str | os.PathLike | None = None,
        section_name: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> "PipelineConfig":
        """Build a config from file section < environment < overrides, validating once at the end."""
        data: dict[str, Any] = {}
        if config_file is not None:
            data = _deep_merge(data, read_config_section(config_file, section_name))
            data["config_file"] = str(config_file)
            data["section_name"] = section_name
        data = _deep_merge(data, env_overrides(os.environ if environ is None else environ))
        data = _deep_merge(data, dict(overrides or {}))
        return build_config(data)


def tensor_parallel_role_error(role: PipelineRole, tensor_parallel_size: int, device: str = "cpu",
                               transport: str = "auto") -> str | None:
    """Why a ``role`` worker on ``device`` with KV ``transport`` cannot run ``tensor_parallel_size`` ranks (None: it
    can). A PrefillOnly or DecodeOnly worker's ranks move their KV re-sliced for the other side's ranks
    (kv_transfer/sharded_cache.py): over ZMQ, from CPU ranks; the launchers check this too."""
    if tensor_parallel_size == 1 or role is PipelineRole.PrefillAndDecode:
        return None
    if device.startswith("cuda"):
        return (f"tensor_parallel_size: a {role.value} worker with tensor_parallel_size={tensor_parallel_size} runs "
                "on CPU only: moving each GPU rank's KV (CUDA IPC per rank) is not built yet; run tensor parallelism "
                "on colocated (PrefillAndDecode) workers on GPUs (docs/tensor-parallel.md)")
    if transport == "shm":
        return (f"transfer.transport: 'shm' writes one cache in place; a {role.value} worker with "
                f"tensor_parallel_size={tensor_parallel_size} moves its ranks' KV over 'zmq' (or 'auto')")
    return None


def build_config(data: Mapping[str, Any]) -> PipelineConfig:
    """Validate ``data`` into a PipelineConfig, turning pydantic errors into one readable ConfigError."""
    try:
        return PipelineConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, PipelineConfig)) from None


def format_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<config>"
        msg = err["msg"].removeprefix("Value error, ").removeprefix(f"{field}: ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field; known fields here: {', '.join(_known_fields(model, err['loc'][:-1]))}"
        elif "input" in err and err["type"] != "missing" and "(got " not in msg:
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{field}: {msg}")
    return "invalid config: " + "; ".join(lines)


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        model = annotation
    return sorted(model.model_fields)


def read_config_section(path: str | os.PathLike, section_name: str | None) -> dict[str, Any]:
    """Read a YAML or TOML file and return ``section_name`` (or the whole file when None)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config_file: no such file: {path}")
    text = path.read_text()
    try:
        if path.suffix in (".toml",):
            content = tomllib.loads(text)
        else:
            content = yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config_file: {path} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {exc}") from None
    if not isinstance(content, dict):
        raise ConfigError(f"config_file: {path} must hold a mapping at the top level")
    if section_name is None:
        return content
    if section_name not in content or not isinstance(content[section_name], dict):
        raise ConfigError(
            f"section_name: {section_name!r} not found in {path}; sections: {', '.join(sorted(content)) or 'none'}"
        )
    return content[section_name]


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``TANDEM_MAX_BATCH_SIZE=8`` -> {"max_batch_size": 8}; ``TANDEM_KV_CACHE__PAGE_SIZE=4`` -> nested.

    Values are parsed as JSON when they parse (numbers, booleans, null), else kept as strings.
    Variables that name no field are ignored here (other tools share the prefix, e.g. TANDEM_HOME).
    """
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split(ENV_NESTED_DELIMITER)]
        if not _is_field_path(path):
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = parse_scalar(raw)
    return out


def _is_field_path(path: list[str]) -> bool:
    model: type[BaseModel] = PipelineConfig
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i < len(path) - 1:
            annotation = field.annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return False
            model = annotation
    return True


def parse_scalar(raw: str) -> Any:
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged
