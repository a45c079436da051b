"""Shared test helpers: tiny checkpoints in Hugging Face format, the transformers reference, leak checks."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

from pipeline.builtin_model import build_checkpoint

# Under pytest-xdist (`make test` runs the suite in several workers) the workers share the cores: each gets
# its share of threads, at least one, so torch's thread pools do not oversubscribe the machine.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _XDIST_WORKERS)))

# Tiny configs: GQA, odd vocabulary sizes, tied and untied embeddings, every architecture's quirks.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        tokenizer_vocab_size=300, extra_vocab=7, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.08,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "mistral": dict(
        tokenizer_vocab_size=300, extra_vocab=13, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, initializer_range=0.08,
        sliding_window=None, head_dim=16,
    ),
    "qwen2": dict(
        tokenizer_vocab_size=300, extra_vocab=1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.08,
    ),
    "qwen3": dict(
        tokenizer_vocab_size=300, extra_vocab=3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        initializer_range=0.08,
    ),
}

ARCHITECTURES = list(TINY_CONFIGS)

# The cluster lane: tests that start real processes (routers, workers, `tandem up`, Ray, pip). The rest is
# the fast lane (`make test-fast`, `pytest -m "not cluster"`): in-process, a few minutes on 2 cores.
REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_LANE = ("tests/cluster/", "tests/deploy/test_cli_processes.py", "tests/deploy/test_up_supervision.py",
                "tests/deploy/test_cpu_binding.py", "tests/deploy/test_ray_up_local_provider.py",
                "tests/deploy/test_generate_cmd.py", "tests/deploy/test_gpu_check.py",
                "tests/bench/test_serve_bench_live.py", "tests/cpu_kernels/test_native_fallback.py", "tests/security/",
                "tests/pipeline/test_tensor_parallel.py",
                "tests/observability/")


# The longest files of the suite, longest first (seconds in `make test`'s three workers, quiet 2-core Zen 4,
# 2026-11-29, ranks preforked). `make test` hands files to its workers in collection order
# (`--no-loadscope-reorder`), so these go first and the short ones fill in around them: the longest-first rule,
# which evens the workers' ends (by default pytest-xdist hands out the files with the most tests first, which left
# one worker ~15 s behind).
LONGEST_FILES = {
    "tests/cluster/test_ray_deploy.py": 104, "tests/deploy/test_up_supervision.py": 53,
    "tests/cluster/test_tensor_parallel_pd.py": 51, "tests/cluster/test_scoring.py": 48,
    "tests/bench/test_serve_bench_live.py": 45, "tests/cluster/test_speculative.py": 44,
    "tests/cluster/test_structured_output.py": 43, "tests/cluster/test_load.py": 43,
    "tests/cluster/test_live_migration.py": 36, "tests/cluster/test_tools.py": 30,
    "tests/router/test_http_faults.py": 14, "tests/deploy/test_cli_processes.py": 26,
    "tests/cluster/test_restarts.py": 25, "tests/pipeline/test_tensor_parallel.py": 24,
    "tests/cluster/test_tensor_parallel_cluster.py": 21, "tests/cluster/test_serving.py": 21,
    "tests/cpu_kernels/test_native_fallback.py": 20, "tests/deploy/test_gpu_check.py": 19,
    "tests/pipeline/test_speculative.py": 18, "tests/observability/test_dashboard_prometheus.py": 18,
    "tests/cluster/test_faults.py": 16, "tests/security/test_multi_host_netns.py": 16,
    "tests/deploy/test_generate_cmd.py": 15, "tests/cluster/test_moe_cluster.py": 15,
    "tests/cluster/test_liveness.py": 15, "tests/cluster/test_kv_routing.py": 14,
    "tests/router/test_only_worker_comes_back.py": 14,
}


def _relative(item) -> str:
    path = Path(str(item.fspath)).resolve()
    return path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _relative(item).startswith(CLUSTER_LANE):
            item.add_marker(pytest.mark.cluster)
    # longest files first, each file's tests in their order (a stable sort: every worker collects the same order)
    items.sort(key=lambda item: -LONGEST_FILES.get(_relative(item), 0))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch)`` -> path of a random-weight HF checkpoint, built once per session."""
    cache: dict[str, str] = {}

    def make(architecture: str = "llama") -> str:
        if architecture not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{architecture}")
            build_checkpoint(path, architecture, **TINY_CONFIGS[architecture])
            cache[architecture] = str(path)
        return cache[architecture]

    return make


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(path)`` -> (transformers model in fp32 eval mode, tokenizer), cached per path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache: dict[str, tuple] = {}

    def load(path: str):
        if path not in cache:
            model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
            cache[path] = (model, AutoTokenizer.from_pretrained(path))
        return cache[path]

    return load


def small_draft_config(arch: str) -> dict:
    """A one-layer model half the target's width with the target's KV layout (kv heads x head dim) and
    another padded vocabulary size (llama: smaller, qwen2: larger; the tokenizer is the same)."""
    target = TINY_CONFIGS[arch]
    head_dim = target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"]
    extra_vocab = {"llama": 2, "qwen2": 6}.get(arch, target["extra_vocab"])
    return {**target, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
            "head_dim": head_dim, "extra_vocab": extra_vocab}


@pytest.fixture(scope="session")
def drafts(tiny_checkpoint, tmp_path_factory):
    from bench.draft_checkpoint import always_wrong_copy, truncated_copy

    """``drafts(arch, kind)`` -> draft model_path: "self" (None), "small" (independent), "wrong", "truncated"."""
    cache: dict[tuple[str, str], str | None] = {}

    def get(arch: str, kind: str) -> str | None:
        if kind == "self":
            return None
        if (arch, kind) not in cache:
            path = tmp_path_factory.mktemp(f"draft-{kind}-{arch}")
            if kind == "small":
                build_checkpoint(path, arch, seed=1, **small_draft_config(arch))
            elif kind == "wrong":
                always_wrong_copy(tiny_checkpoint(arch), path)
            else:
                truncated_copy(tiny_checkpoint(arch), path, 1)
            cache[arch, kind] = str(path)
        return cache[arch, kind]

    return get


def greedy(max_tokens: int, **kwargs):
    """Greedy SamplingParams with EOS ignored (what transformers' ``hf_greedy`` is compared against)."""
    from pipeline import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    """transformers' own greedy generate() for one unpadded prompt (EOS ignored unless asked)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if ignore_eos else 0,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Log-softmax of transformers' logits at every position: [len(token_ids), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_greedy_and_logprobs(llm, hf_model, prompts: list[list[int]], num_new_tokens: int, atol: float) -> list:
    """``llm``'s greedy tokens for ``prompts`` are transformers' (``hf_greedy``), and each step's top logprobs
    are within ``atol`` of transformers' log-softmax; returns the outputs."""
    outs = llm.generate(prompts, greedy(num_new_tokens, logprobs=2))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, num_new_tokens)
        reference = hf_logprobs(hf_model, prompt + out.token_ids)  # [len, vocab]
        for step, entry in enumerate(out.logprobs):
            row = reference[len(prompt) - 1 + step]
            assert max(abs(logprob - row[token].item()) for token, logprob in entry.items()) < atol
    return outs


def check_cached_continuations(llm, hf_model, prompts: list[list[int]], min_cached_tokens: int,
                               num_new_tokens: int = 6) -> None:
    """Prompts whose first blocks ``llm``'s prefix cache holds: transformers' greedy tokens, and more than
    ``min_cached_tokens`` of them read from the cache instead of computed again."""
    computed_before = llm.engine.num_prompt_tokens_computed
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(num_new_tokens))):
        assert out.token_ids == hf_greedy(hf_model, prompt, num_new_tokens)
    assert llm.engine.num_prompt_tokens_computed - computed_before < sum(map(len, prompts)) - min_cached_tokens


def assert_no_leaks(kv_manager, num_free_at_start: int) -> None:
    """Every block is back in the free pool (prefix-cached blocks with no holder count as free)."""
    assert kv_manager.num_free_blocks == num_free_at_start, (
        f"KV block leak: {num_free_at_start - kv_manager.num_free_blocks} blocks still held"
    )
