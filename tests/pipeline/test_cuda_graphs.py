"""Decode CUDA graphs' static, padded inputs (pipeline/cuda_graphs.py) change no token: on this CPU machine the graphs
are emulated (the same static buffers and padding, run eagerly: nothing to capture without CUDA), and every family's
greedy tokens stay transformers' own, with the overlap scheduler too. The capture and its replay check run on a GPU
(tests/gpu/test_cuda_engine.py, graphs on and off)."""

from __future__ import annotations

import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline.cuda_graphs import DecodeGraphs, capture_sizes
from pipeline.forward_batch import ForwardBatch
from tests.conftest import hf_greedy
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import generate_and_check, make_prompts

FAMILIES = {  # name -> (the fixture that builds it, its name there)
    "llama": ("tiny_checkpoint", "llama"),
    "qwen3_moe": ("moe_checkpoint", "qwen3_moe"),
    "gemma3": ("gemma3_checkpoint", "gemma3"),
    "gpt_oss": ("gpt_oss_checkpoint", "gpt_oss"),
    "deepseek_v3": ("deepseek_checkpoint", "deepseek_v3"),
}
PROMPT_LENGTHS = [3, 17, 5, 29, 11, 1]  # past the sliding windows of the Gemma 3 / gpt-oss models
NUM_NEW_TOKENS = 12
MAX_BATCH_SIZE = 8  # graphs for 1, 2, 4, 8: batches of 3, 5, 6 run padded


@pytest.fixture(scope="module")
def family(request, hf_reference):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            fixture, checkpoint_name = FAMILIES[name]
            path = request.getfixturevalue(fixture)(checkpoint_name)
            model, _ = hf_reference(path)
            prompts = make_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=5)
            cache[name] = (path, prompts, [hf_greedy(model, p, NUM_NEW_TOKENS) for p in prompts])
        return cache[name]

    return get


def emulate_graphs(llm: LLM) -> list[int]:
    """Give ``llm``'s runner emulated decode graphs; returns the batch sizes they ran (filled as steps run)."""
    engine = llm.engine
    graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.kernels, engine.device, MAX_BATCH_SIZE,
                          engine.runner.buffer.block_table.shape[1], emulate=True)
    ran: list[int] = []
    replay = graphs.logits

    def counting(batch):
        ran.append(batch.num_seqs)
        return replay(batch)

    graphs.logits = counting
    engine.runner.graphs = graphs
    return ran


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("name", FAMILIES)
def test_padded_decode_batches_change_no_token(name, overlap, family):
    path, prompts, expected = family(name)
    llm = LLM(model=path, max_batch_size=MAX_BATCH_SIZE, max_batch_input_tokens=24, enable_overlap_scheduler=overlap,
              kv_cache={"page_size": 4, "num_blocks": 128})
    ran = emulate_graphs(llm)
    generate_and_check(llm, prompts, expected, NUM_NEW_TOKENS)
    assert any(n not in capture_sizes(MAX_BATCH_SIZE) for n in ran), f"no padded batch ran: {sorted(set(ran))}"


def test_logprobs_and_prompt_logprobs_are_unchanged(family):
    path, prompts, _ = family("llama")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=2)
    plain = LLM(model=path, max_batch_size=MAX_BATCH_SIZE, kv_cache={"page_size": 4, "num_blocks": 128})
    with_graphs = LLM(model=path, max_batch_size=MAX_BATCH_SIZE, kv_cache={"page_size": 4, "num_blocks": 128})
    ran = emulate_graphs(with_graphs)
    for want, got in zip(plain.generate(prompts, params), with_graphs.generate(prompts, params)):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs and got.prompt_logprobs == want.prompt_logprobs
    assert ran  # decode steps replayed; the prompt steps (prompt logprobs) ran eagerly


def test_only_decode_batches_fit():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.sizes = capture_sizes(4)
    graphs.inputs = ForwardBatch(*(torch.zeros(1) for _ in range(5)), block_tables=torch.zeros(4, 10),
                                 logits_indices=torch.zeros(1))

    def batch(num_seqs, num_tokens, num_sampled, width=10):
        return ForwardBatch(input_ids=torch.zeros(num_tokens), positions=torch.zeros(num_tokens),
                            cu_seqlens_q=torch.zeros(num_seqs + 1), context_lens=torch.zeros(num_seqs),
                            slot_mapping=torch.zeros(num_tokens), block_tables=torch.zeros(num_seqs, width),
                            logits_indices=torch.zeros(num_sampled))

    assert graphs.fits(batch(3, 3, 3))
    assert not graphs.fits(batch(3, 5, 3))  # a prompt chunk, or a speculative verify step
    assert not graphs.fits(batch(3, 3, 2))  # a one-token prompt chunk that is not sampled
    assert not graphs.fits(batch(5, 5, 5))  # larger than the largest graph
    assert not graphs.fits(batch(3, 3, 3, width=11))  # wider block tables than the static ones
