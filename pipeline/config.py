"""PipelineConfig: the one source of truth for how a Tandem process runs.

Field names follow Modular MAX's ``max.pipelines.lib.config.PipelineConfig``. A config is built from
(lowest to highest precedence) defaults, a YAML/TOML file section, ``TANDEM_*`` environment variables
and explicit overrides (CLI flags or keyword arguments). Any invalid value raises ``ConfigError``
naming the field and what it accepts.
"""

from __future__ import annotations

import enum
import os
from typing import Any, Literal, Mapping

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from pipeline.config_sections import (  # noqa: F401  (re-exported: every section is importable from here)
    ConfigSection, DraftModelConfig, KVCacheConfig, ModelConfig, RouterConfig, SamplingConfig, SecurityConfig,
    SpeculativeConfig, TransferConfig)
from pipeline.config_sources import (  # noqa: F401  (re-exported)
    ConfigError, deep_merge, format_validation_error, parse_scalar, read_config_section)

ENV_PREFIX = "TANDEM_"
ENV_NESTED_DELIMITER = "__"


class PipelineRole(str, enum.Enum):
    PrefillAndDecode = "PrefillAndDecode"
    PrefillOnly = "PrefillOnly"
    DecodeOnly = "DecodeOnly"


class PipelineConfig(ConfigSection):
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
    max_prefill_tokens_beside_decodes: int | None = Field(
        None, ge=1, description="chunked prefill: prompt tokens a step computes beside running decodes, so a prompt "
        "lengthens every running request's next token (TPOT) by at most that chunk's time (a DecodeOnly worker "
        "prefilling prompts the router spills to it, router.prefill_spill_tokens); a step with nothing to decode "
        "takes the full max_batch_input_tokens; None = no cap (docs/load.md)")
    kvcache_ce_watermark: float = Field(
        0.95, gt=0.0, le=1.0, description="admit a prefill only while KV use stays under this fraction"
    )
    enable_overlap_scheduler: bool = Field(
        False, description="launch each engine step before reading the previous one's tokens, so the host "
        "schedules and prepares while the model computes (MAX's overlap scheduler; docs/overlap.md)")
    enforce_eager: bool = Field(
        False, description="CUDA: run every step eagerly instead of replaying the decode batches' captured CUDA graphs "
        "(vLLM's flag; graphs are captured at start-up and checked against the eager forward; pipeline/cuda_graphs.py)")
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
    cpu_keep_freed_memory: bool = Field(
        True, description="CPU: the C heap keeps the memory a step frees for the next step (glibc: blocks up to 32 MiB "
        "from its heap, no trim below 1 GiB free) instead of faulting it back in, zeroed, every step; the peak "
        "resident memory is unchanged, but a worker stays at its peak (docs/cpu-kernels.md)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="rank processes one model is split across, Megatron-style (heads, MLP columns, vocab); "
        "1 = one process. Every role and architecture, quantized checkpoints included; a prefill and a decode "
        "worker's sizes may differ (docs/tensor-parallel.md)")
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
            data = deep_merge(data, read_config_section(config_file, section_name))
            data["config_file"] = str(config_file)
            data["section_name"] = section_name
        data = deep_merge(data, env_overrides(os.environ if environ is None else environ))
        data = deep_merge(data, dict(overrides or {}))
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
    if transport in ("shm", "cuda_ipc"):
        return (f"transfer.transport: {transport!r} writes one cache in place; a {role.value} worker with "
                f"tensor_parallel_size={tensor_parallel_size} moves its ranks' KV over 'zmq' (or 'auto')")
    return None


def build_config(data: Mapping[str, Any]) -> PipelineConfig:
    """Validate ``data`` into a PipelineConfig, turning pydantic errors into one readable ConfigError."""
    try:
        return PipelineConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, PipelineConfig)) from None


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
        node[path[-1]] = parse_field_value(path, raw)
    return out


def config_env_names(environ: Mapping[str, str]) -> list[str]:
    """The ``TANDEM_*`` variables of ``environ`` that set a config field (the ones ``env_overrides`` reads)."""
    return [key for key in environ if key.startswith(ENV_PREFIX)
            and _is_field_path([p.lower() for p in key[len(ENV_PREFIX):].split(ENV_NESTED_DELIMITER)])]


def _is_field_path(path: list[str]) -> bool:
    return _field_at(path) is not None


def _field_at(path: list[str]):
    """The pydantic FieldInfo of the (nested) field at ``path``, or None when it names none."""
    model: type[BaseModel] = PipelineConfig
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return None
        if i < len(path) - 1:
            annotation = field.annotation
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                return None
            model = annotation
        else:
            return field
    return None


def parse_field_value(path: list[str], raw: str) -> Any:
    """A flag's or a TANDEM_* variable's text for the field at ``path``: the text itself for a text field (a
    served name "2024", a path "123", a CORS origin "null"), else parsed as JSON when it parses (numbers,
    booleans, null, a whole section as an object), else the text."""
    field = _field_at(path)
    if field is not None and field.annotation in (str, str | None):
        return raw
    return parse_scalar(raw)
