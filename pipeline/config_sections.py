"""The sections of ``PipelineConfig`` (pydantic, MAX field names): model, draft model, speculative decoding,
KV cache, sampling, KV transfer, router and security settings, each with what it accepts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ConfigSection(BaseModel):
    """A config section: unknown fields are errors, and so are invalid values assigned later and non-finite numbers
    (a timeout or a rate of ``inf`` / ``nan``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(ConfigSection):
    """Which checkpoint to load and where to run it."""

    model_path: str | None = Field(None, description="Hugging Face checkpoint directory; None = built-in model")
    served_model_name: str | None = Field(
        None, description="the names the API serves the model under, comma-separated (the first is the one "
        "responses and /v1/models give first); None = the checkpoint folder's name")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="weights and KV cache dtype; auto = on CPU the checkpoint's (config.json's dtype: "
        "bfloat16 and float16 checkpoints run in bfloat16, float32 ones or none stated in float32), bfloat16 on GPU")
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:N' or 'auto'")
    seed: int = Field(0, ge=0, description="seed of the global generator (unseeded requests)")
    cpu_weight_prepack: bool = Field(
        True, description="CPU: keep a copy of every linear weight packed for oneDNN, used for every batch on an "
        "AVX-512 CPU (which then drops the checkpoint layout: the weights held once) and for batches of 2-256 rows "
        "elsewhere, where it is faster than the checkpoint layout (both kept there: twice the weights' memory)")
    quantization: Literal["int8"] | None = Field(
        None, description="quantize a float checkpoint's linear layers at load (vLLM's --quantization): int8 = W8A8, "
        "int8 weights per output channel and int8 activations per token (docs/models.md); None = as the checkpoint "
        "is (a quantized checkpoint runs quantized either way)")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, checkpoint_dtype: str | None = None) -> str:
        """The dtype to run in; ``checkpoint_dtype`` is the one the checkpoint's config.json states (None: none).
        It depends on the checkpoint and the device only, never on the CPU's flags: P/D peers on different CPUs
        resolve the same KV dtype. float16 runs as bfloat16 on a CPU (the native kernels take fp32 and bf16)."""
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device() != "cpu":
            return "bfloat16"
        return "bfloat16" if checkpoint_dtype in ("bfloat16", "float16") else "float32"


class DraftModelConfig(ConfigSection):
    """The draft model of speculative decoding (MAX's ``draft_model``); it runs in the target's dtype and device."""

    model_path: str | None = Field(
        None, description="the draft's Hugging Face checkpoint directory (any supported architecture, the target's "
        "tokenizer); None = the target itself")


class SpeculativeConfig(ConfigSection):
    """Speculative decoding: the draft proposes tokens, one target forward checks them all (docs/speculative.md)."""

    num_speculative_tokens: int = Field(
        0, ge=0, le=16, description="tokens the draft model proposes per step (K, vLLM's name); 0 = off")


class KVCacheConfig(ConfigSection):
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


class SamplingConfig(ConfigSection):
    """Defaults applied to requests that leave a parameter unset."""

    temperature: float = Field(1.0, ge=0.0, description="default temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="default nucleus threshold")
    top_k: int = Field(-1, ge=-1, description="default top-k (-1 = off)")
    max_tokens: int = Field(
        256, ge=1, description="default output length of the offline API; the HTTP API's default is the rest of "
        "the context on every endpoint (as vLLM's chat endpoint; vLLM's and OpenAI's /v1/completions default to "
        "16) unless this is set explicitly or the checkpoint's generation_config.json sets max_new_tokens")
    structured_output_backend: Literal["llguidance", "xgrammar"] = Field(
        "llguidance", description="grammar backend of structured output requests that name none")
    generation_config: Literal["auto", "ignore"] = Field(
        "auto", description="auto: the checkpoint's generation_config.json sampling defaults (temperature, top_p, "
        "top_k, min_p, repetition_penalty, max_new_tokens) fill what a request leaves unset, below values set in "
        "this section; ignore: only this section (its EOS ids end generation either way)")


class TransferConfig(ConfigSection):
    """How KV moves from prefill to decode workers, and how long a decode worker waits for it."""

    transport: Literal["auto", "zmq", "shm", "cuda_ipc"] = Field(
        "auto", description="auto: CUDA IPC between GPU workers on one host, shared memory between CPU workers on one "
        "host, else ZMQ")
    ttl_s: float = Field(30.0, gt=0.0, description="a KV transfer is given up after this long without progress: "
                         "the prefill worker silent before it starts the prompt, or no chunk computed / no KV landed "
                         "since the last (a queue at the prefill worker does not count)")
    heartbeat_interval_s: float = Field(0.5, gt=0.0, description="worker -> router heartbeat period")
    kv_migration_on_drain: bool = Field(
        True, description="a draining DecodeOnly worker hands its running streams, with their KV, to another "
        "DecodeOnly worker the router picks (nothing recomputed; docs/migration.md); false = they finish where "
        "they are within drain_timeout_s")


class RouterConfig(ConfigSection):
    """How the router decides who is alive, what to admit and where to prefill."""

    dead_after_s: float = Field(
        3.0, gt=0.0, description="a worker silent this long is dead (heartbeats come from a thread no step blocks)")
    forget_dead_worker_after_s: float = Field(
        300.0, gt=0.0, description="a worker dead this long leaves /ready and the per-worker metrics (scaled "
        "down, or given up by its launcher); if it comes back it registers anew. Never less than wait_for_worker_s")
    max_queued_requests: int = Field(
        256, ge=0, description="requests that wait in the router while every worker is saturated; beyond: 429")
    queue_timeout_s: float = Field(
        60.0, gt=0.0, description="a request that waited this long for a free worker gets 429")
    max_local_prefill_length: int = Field(
        32, ge=0, description="DecodeOnly workers prefill prompts up to this many tokens themselves (0 = never); see docs/load.md")
    prefill_spill_tokens: int | None = Field(
        None, ge=0, description="a DecodeOnly worker also prefills a longer prompt itself when the prefill worker's "
        "queue (prompt tokens) exceeds its own plus the prompt by at least this many (queue-aware conditional "
        "disaggregation: more throughput at saturation, longer decode steps on that worker while it prefills; "
        "docs/load.md); None = never")
    request_timeout_s: float = Field(600.0, gt=0.0, description="a request unfinished after this gets 504")
    max_request_body_mib: float = Field(
        8.0, gt=0.0, description="a request body larger than this gets 413 before it is read (a 128k-token prompt "
        "is about 0.5 MiB of text or 1 MiB of token ids); what passes is tokenized off the HTTP event loop")
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
    early_prefill_hold_s: float = Field(
        2.0, gt=0.0, description="how long a prefill worker keeps an early prefill's blocks for its decode worker's "
        "claim; a later claim finds the prompt in the prefix cache and computes its last block again "
        "(tandem_worker_early_prefills_unclaimed_total counts them: raise this where decode workers ask late)")
    wait_for_worker_s: float = Field(
        30.0, ge=0.0, description="a request whose worker died while no other can serve it (the one decode worker "
        "of a 1P1D cluster) waits this long for one to register (tandem up restarts a crashed worker) and then "
        "goes on there, its stream paused meanwhile; so do requests queued or arriving then; 0 = they fail at once")
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


class SecurityConfig(ConfigSection):
    """Cluster socket security (docs/security.md): CurveZMQ with one cluster key on every tcp:// socket."""

    cluster_key_file: str | None = Field(
        None, description="the cluster key (cluster.key_secret from `tandem keygen`); every process of a cluster "
        "needs the same one; tcp:// sockets then admit only peers that hold it and are encrypted")
    insecure_cluster: bool = Field(
        False, description="let a process with a tcp:// endpoint base and no cluster key start anyway (anyone "
        "who reaches its ports can then join the cluster, read prompts and write KV)")
