"""Tensor parallelism offline (pipeline/parallel): two rank processes give transformers' fp32 tokens and logprobs,
what it cannot run is refused by name, and no rank process outlives its LLM, even one that dies or hangs."""

from __future__ import annotations

import datetime
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline import LLM
from pipeline.parallel import TensorParallelError
from tests.conftest import TINY_CONFIGS, check_greedy_and_logprobs, greedy, hf_logprobs
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)

PROMPTS = [[1, 5, 9, 2, 7], list(range(3, 40)), [11, 4], [8] * 21]
# a small step budget, so the long prompts are prefilled in chunks across steps
ENGINE = dict(model_config={"dtype": "float32"}, max_batch_input_tokens=16, kv_cache={"page_size": 4, "num_blocks": 96})


def tp_llm(path: str, **overrides) -> LLM:
    return LLM(path, **{**ENGINE, "tensor_parallel_size": 2, **overrides})


def is_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet has stopped running: it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if is_running(p)]


@pytest.fixture(scope="module")
def llama_tp(tiny_checkpoint):
    """One TP=2 Llama (GQA: 4 q heads, 2 KV heads, one per rank; untied, a vocabulary of 307 that 2 does not divide)."""
    llm = tp_llm(tiny_checkpoint("llama"))
    yield llm
    llm.close()


def test_llama_greedy_and_logprobs_match_transformers(llama_tp, tiny_checkpoint, hf_reference):
    hf_model, _ = hf_reference(tiny_checkpoint("llama"))
    assert llama_tp.engine.kv_cache.shape[-2] == 1  # this rank's KV heads: one of two
    check_greedy_and_logprobs(llama_tp, hf_model, PROMPTS, 12, atol=1e-4)


def test_the_ranks_listen_on_no_interface_but_loopback(llama_tp):
    """A keyed cluster admits no stranger: the ranks meet through a store file in a private directory (gone once
    they are connected) and gloo's sockets are on loopback, so nothing a tensor-parallel worker opens is reachable
    from another host (a TCPStore listens on every interface)."""
    import psutil

    group = llama_tp.engine.model.driver
    assert not os.path.exists(os.path.dirname(group.store.path))
    listening = [(pid, conn.laddr) for pid in [os.getpid(), *group.pids]
                 for conn in psutil.Process(pid).net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN]
    assert listening and all(address.ip in ("127.0.0.1", "::1") for _, address in listening), listening


def test_prefix_cached_prompt_and_prompt_logprobs_match_transformers(llama_tp, tiny_checkpoint, hf_reference):
    hf_model, _ = hf_reference(tiny_checkpoint("llama"))
    prompt = list(range(3, 40)) + [5, 6, 7]  # shares its first blocks with a prompt run before: cached KV is reused
    llama_tp.generate([prompt[:37]], greedy(1))
    computed_before = llama_tp.engine.num_prompt_tokens_computed
    check_greedy_and_logprobs(llama_tp, hf_model, [prompt], 6, atol=1e-4)
    assert llama_tp.engine.num_prompt_tokens_computed - computed_before < len(prompt)  # a prefix came from the cache
    out = llama_tp.generate([prompt], greedy(4, prompt_logprobs=1))[0]  # scored over the whole prompt
    reference = hf_logprobs(hf_model, prompt)  # [len, vocab]
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = prompt[position]
        assert abs(entry[token] - reference[position - 1, token].item()) < 1e-4


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory) -> str:
    """Llama with biases on every projection: o_proj's and down_proj's are added once, on rank 0."""
    from pipeline.builtin_model import build_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama-biased")
    build_checkpoint(path, "llama", **{**TINY_CONFIGS["llama"], "attention_bias": True, "mlp_bias": True})
    return str(path)


@pytest.mark.parametrize("name", ["qwen3", "llama_biased"])
def test_other_layouts_match_transformers(name, tiny_checkpoint, biased_llama, hf_reference):
    # qwen3: q/k norms, head_dim 32 != hidden / heads; llama_biased: q/k/v (column-parallel) and o/down
    # (row-parallel) biases. Qwen2 differs from these only in which projections have biases.
    path = biased_llama if name == "llama_biased" else tiny_checkpoint(name)
    with tp_llm(path) as llm:
        check_greedy_and_logprobs(llm, hf_reference(path)[0], PROMPTS, 10, atol=1e-4)
        pids = llm.engine.model.driver.pids
    assert wait_gone(pids) == []  # the context manager closed the ranks


def test_one_kv_head_is_replicated_on_both_ranks(tiny_checkpoint, hf_reference):
    path = tiny_checkpoint("mistral")  # num_key_value_heads=1 < tp=2; tied embeddings; head_dim 16
    llm = tp_llm(path)
    assert llm.engine.kv_cache.shape[-2] == 1
    check_greedy_and_logprobs(llm, hf_reference(path)[0], PROMPTS[:2], 10, atol=1e-4)
    pids = llm.engine.model.driver.pids
    assert pids and all(is_running(p) for p in pids)
    del llm
    gc.collect()  # no close(): garbage collection stops the ranks
    assert wait_gone(pids) == []


@pytest.mark.parametrize("name, backend", [
    ("gemma3", "cpu"),  # local layers (window 8) among global ones, two RoPE caches, softcapped logits, tied
    ("gemma3_untied", "torch"),  # one KV head (replicated on both ranks), biases, untied, window 6
])
def test_gemma3_greedy_and_logprobs_match_transformers(name, backend, gemma3_checkpoint, hf_reference):
    """Gemma's embedding scale after the vocabulary-parallel lookup, its post-norms after each reduced output, the
    per-head q/k norms replicated; prompts longer than the window."""
    path = gemma3_checkpoint(name)
    with tp_llm(path, kernel_backend=backend) as llm:
        assert llm.engine.model.model.embed_tokens.scale is not None
        check_greedy_and_logprobs(llm, hf_reference(path)[0], PROMPTS, 10, atol=1e-4)
        pids = llm.engine.model.driver.pids
    assert wait_gone(pids) == []


def test_the_overlap_pipeline_drives_the_ranks(tiny_checkpoint, hf_reference):
    """enable_overlap_scheduler: each step runs on the execution stream's thread, which drives the other ranks
    (its placeholder tokens filled before the batch is sent to them); greedy tokens and logprobs stay
    transformers'."""
    path = tiny_checkpoint("llama")
    with tp_llm(path, enable_overlap_scheduler=True) as llm:
        engine = llm.engine
        engine.add_request("launched-not-read", [5, 6, 7, 8, 9], greedy(2))
        assert engine.step() == [] and engine.has_pending_outputs()  # overlapped: launched, not read
        while engine.has_unfinished_requests():
            engine.step()
        check_greedy_and_logprobs(llm, hf_reference(path)[0], PROMPTS, 12, atol=1e-4)


@pytest.fixture(scope="module")
def rank_layout_draft(tmp_path_factory) -> str:
    """A one-layer draft whose KV layout per layer (1 head of 16) is a rank's of the tiny Llama (2 heads of 16)."""
    from pipeline.builtin_model import build_checkpoint
    from tests.conftest import small_draft_config

    path = tmp_path_factory.mktemp("draft-rank-layout")
    build_checkpoint(path, "llama", seed=1, **{**small_draft_config("llama"), "num_key_value_heads": 1})
    return str(path)


@pytest.mark.parametrize("kind", ["truncated", "rank_layout"])
def test_speculative_decoding_with_a_split_target(kind, tiny_checkpoint, drafts, rank_layout_draft, hf_reference):
    """A draft checkpoint runs whole on rank 0, its KV in a cache of its own (even one whose layout per layer is a
    rank's, so the other ranks' caches hold the target's layers only); each verify is one forward of the split
    target: greedy tokens stay transformers' and every block comes back."""
    from tests.conftest import assert_no_leaks, hf_greedy

    path = tiny_checkpoint("llama")
    hf_model, _ = hf_reference(path)
    draft = rank_layout_draft if kind == "rank_layout" else drafts("llama", kind)
    with tp_llm(path, draft_model={"model_path": draft}, speculative={"num_speculative_tokens": 3},
                kv_cache={"page_size": 4, "num_blocks": 128}) as llm:
        engine = llm.engine
        assert engine.kv_cache.shape[0] == hf_model.config.num_hidden_layers  # the target's layers alone
        free_at_start = engine.kv_manager.num_free_blocks
        outputs = llm.generate(PROMPTS, greedy(12))
        assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, 12) for p in PROMPTS]
        stats = engine.speculator.stats
        assert stats.num_draft_tokens > 0
        if kind == "truncated":  # the target's first layer: some of its drafts are the target's own tokens
            assert stats.num_accepted_tokens > 0
        assert_no_leaks(engine.kv_manager, free_at_start)


def test_speculation_the_ranks_cannot_run_is_refused_by_name(tiny_checkpoint, drafts):
    from pipeline.config import PipelineConfig
    from pipeline.parallel import load_tensor_parallel_model

    children_before = set(_descendants())
    with pytest.raises(TensorParallelError, match="needs a draft checkpoint"):  # the target drafting for itself
        tp_llm(tiny_checkpoint("llama"), speculative={"num_speculative_tokens": 3})
    config = PipelineConfig.load(overrides={
        "tensor_parallel_size": 2, "pipeline_role": "DecodeOnly", "model": {"model_path": tiny_checkpoint("llama")},
        "draft_model": {"model_path": drafts("llama", "small")}, "speculative": {"num_speculative_tokens": 3}})
    with pytest.raises(TensorParallelError, match="colocated workers only: a DecodeOnly worker ships the draft's KV"):
        load_tensor_parallel_model(config, tiny_checkpoint("llama"), torch.float32, "cpu")
    assert set(_descendants()) <= children_before  # refused before any rank was started


@pytest.mark.parametrize("case, expected", [
    ("three_ranks", "tensor_parallel_size=3 must divide num_attention_heads=4"),
])
def test_unsupported_setups_are_refused_by_name(case, expected, tiny_checkpoint):
    """(An architecture with no shard: tests/pipeline/test_tensor_parallel_moe.py; block scales a rank would cut:
    tests/pipeline/test_tensor_parallel_quantized.py.)"""
    children_before = set(_descendants())
    path, overrides = tiny_checkpoint("llama"), {}
    if case == "three_ranks":
        overrides["tensor_parallel_size"] = 3
    with pytest.raises(TensorParallelError, match=expected):
        tp_llm(path, **overrides)
    assert set(_descendants()) <= children_before  # refused before any rank was started


def test_a_rank_that_fails_to_load_is_reported_and_stopped(tiny_checkpoint, tmp_path, monkeypatch):
    import dataclasses
    from multiprocessing import forkserver

    from pipeline.parallel import rank_start

    context = rank_start.rank_context()

    class BrokenChildren:  # rank 1 is told to read a directory with no checkpoint in it; rank 0 reads the real one
        Pipe = context.Pipe

        def Process(self, target, args, **kwargs):
            rank_args, pipe = args
            return context.Process(target=target, args=(dataclasses.replace(rank_args, model_path=str(tmp_path)),
                                                        pipe), **kwargs)

    # the fork server (and its resource tracker) live as long as this process: started here, they are not counted
    # as ranks left behind
    forkserver.ensure_running()
    children_before = set(_descendants())
    monkeypatch.setattr(rank_start, "rank_context", lambda: BrokenChildren())
    with pytest.raises(TensorParallelError, match="rank 1 .*(failed to start|exited).*config"):
        tp_llm(tiny_checkpoint("llama"))
    assert wait_gone(list(set(_descendants()) - children_before)) == []


def test_size_one_is_the_single_process_engine(tiny_checkpoint):
    from pipeline.models.llama import LlamaFamilyForCausalLM

    children_before = set(_descendants())
    with LLM(tiny_checkpoint("llama"), **ENGINE) as llm:  # tensor_parallel_size defaults to 1
        assert type(llm.engine.model) is LlamaFamilyForCausalLM
        assert llm.engine.kv_cache.shape[-2] == 2  # every KV head here
        assert set(_descendants()) <= children_before


@pytest.mark.parametrize("role", ["PrefillOnly", "DecodeOnly"])
def test_prefill_and_decode_roles_refuse_what_their_ranks_cannot_run_in_their_config(role):
    """Their ranks' KV moves re-sliced over ZMQ from CPU ranks (tests/cluster/test_tensor_parallel_pd.py): GPU ranks
    and the in-place shm transport are refused when the config is read, before any worker or rank starts."""
    from pipeline.config import ConfigError, PipelineConfig

    with pytest.raises(ConfigError, match=f"a {role} worker with tensor_parallel_size=2 runs on CPU only"):
        PipelineConfig.load(overrides={"tensor_parallel_size": 2, "pipeline_role": role, "model": {"device": "cuda"}})
    with pytest.raises(ConfigError, match="'shm' writes one cache in place"):
        PipelineConfig.load(overrides={"tensor_parallel_size": 2, "pipeline_role": role, "transfer": {"transport": "shm"}})
    assert PipelineConfig.load(overrides={"tensor_parallel_size": 2, "pipeline_role": role}).tensor_parallel_size == 2
    assert PipelineConfig.load(overrides={"tensor_parallel_size": 2, "model": {"device": "cuda"}}).tensor_parallel_size == 2


def test_no_rank_outlives_a_killed_engine_process(tiny_checkpoint):
    script = (
        "import sys, time\n"
        "from pipeline import LLM\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache={'num_blocks': 32})\n"
        "    print(*llm.engine.model.driver.pids, flush=True)\n"
        "    time.sleep(600)\n"
    )
    engine = subprocess.Popen([sys.executable, "-c", script, tiny_checkpoint("llama")], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert pids and all(is_running(p) for p in pids)
    finally:
        engine.kill()  # SIGKILL: no close(), no atexit; the ranks see their pipe close
        engine.wait()
    assert wait_gone(pids) == []


def test_a_rank_killed_mid_step_is_named_with_its_exit_code(tiny_checkpoint):
    """The collective fails as the kernel closes the dead rank's socket, a moment before the process is seen to have
    exited: the error names the rank and its signal all the same (it used to give only gloo's connection reset)."""
    llm = tp_llm(tiny_checkpoint("llama"))
    [pid] = llm.engine.model.driver.pids
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    try:
        killer.start()
        with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {pid}\\) exited with code -9: the engine"):
            llm.generate([list(range(3, 40))] * 8, greedy(2000))
    finally:
        killer.cancel()
        llm.close()
    assert wait_gone([pid]) == []


@pytest.mark.slow  # two interpreters importing torch: 11-21 s of the default suite for one message
def test_a_script_without_a_main_guard_is_told_why_its_rank_died(tmp_path):
    """Each rank imports the user's script again (multiprocessing's fork server does), so an LLM created at its
    top level starts a rank that dies in its bootstrap without a word to rank 0. The error says why."""
    script = tmp_path / "no_guard.py"
    script.write_text("from pipeline import LLM\nLLM(None, tensor_parallel_size=2, model_config={'dtype': 'float32'})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 1
    assert "exited with code 1 before it started (its traceback is on stderr; a script that creates a " \
        "tensor-parallel LLM must do so under `if __name__ == \"__main__\":`" in done.stderr.splitlines()[-1]


def test_hung_then_killed_rank_raise_clear_errors_and_leave_no_process(llama_tp, monkeypatch):
    """Last in the module: it breaks the shared LLM. Rank 1 is stopped (SIGSTOP), then killed."""
    llm = llama_tp
    group = llm.engine.model.driver
    monkeypatch.setattr(llm.engine.model.collectives, "timeout", datetime.timedelta(seconds=3))
    [pid] = group.pids
    try:
        os.kill(pid, signal.SIGSTOP)  # rank 1 stops answering mid-run
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="collective failed on rank 0"):
            llm.generate([PROMPTS[0]], greedy(4))
        assert time.monotonic() - started < 30
        os.kill(pid, signal.SIGKILL)
        group.processes[0].join(10)  # then rank 1 dies
        with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {pid}\\) exited with code -9"):
            llm.generate([PROMPTS[0]], greedy(4))
    finally:
        llm.close()
    assert wait_gone([pid]) == []
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_total_blocks  # the failed requests let go


def _descendants() -> list[int]:
    """Pids of this process's live descendants (Linux): ranks are the fork server's children, not this process's."""
    parents = {}
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(status.parent.name)] = int(fields[1])
    found, frontier = [], {os.getpid()}
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = set(children)
    return found
