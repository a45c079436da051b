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
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_engine_exactness import NUM_NEW_TOKENS as DENSE_NEW_TOKENS
from tests.pipeline.test_engine_exactness import generate_and_check, references  # noqa: F401 (a fixture)
from tests.pipeline.test_model_families_modes import FAMILIES, NUM_NEW_TOKENS, family  # noqa: F401 (a fixture)

MAX_BATCH_SIZE = 8  # graphs for 1, 2, 4, 8: batches of 3, 5, 6, 7 run padded


def family_case(name: str, family, references, tiny_checkpoint) -> tuple[str, list, list, int]:
    """(checkpoint, prompts, transformers' greedy tokens, how many) for a dense architecture or another family."""
    if name in FAMILIES:
        return (*family(name), NUM_NEW_TOKENS)
    return (tiny_checkpoint(name), *references(name), DENSE_NEW_TOKENS)


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
@pytest.mark.parametrize("name", ["llama", *FAMILIES])
def test_padded_decode_batches_change_no_token(name, overlap, family, references, tiny_checkpoint):
    path, prompts, expected, num_new_tokens = family_case(name, family, references, tiny_checkpoint)
    llm = LLM(model=path, max_batch_size=MAX_BATCH_SIZE, max_batch_input_tokens=24, enable_overlap_scheduler=overlap,
              kv_cache={"page_size": 4, "num_blocks": 192})
    ran = emulate_graphs(llm)
    generate_and_check(llm, prompts, expected, num_new_tokens)
    assert any(n not in capture_sizes(MAX_BATCH_SIZE) for n in ran), f"no padded batch ran: {sorted(set(ran))}"


def test_logprobs_and_prompt_logprobs_are_unchanged(references, tiny_checkpoint):
    prompts, _ = references("llama")
    path = tiny_checkpoint("llama")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, prompt_logprobs=2)
    plain = LLM(model=path, max_batch_size=MAX_BATCH_SIZE, kv_cache={"page_size": 4, "num_blocks": 192})
    with_graphs = LLM(model=path, max_batch_size=MAX_BATCH_SIZE, kv_cache={"page_size": 4, "num_blocks": 192})
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


def test_a_capture_that_fails_leaves_graphs_off_with_a_warning(monkeypatch, caplog, tiny_checkpoint):
    """Whatever keeps a graph from being trusted (here: CUDA missing altogether), the worker runs eagerly."""
    from pipeline import cuda_graphs

    llm = LLM(model=tiny_checkpoint("llama"), kv_cache={"page_size": 4, "num_blocks": 32})
    monkeypatch.setattr(cuda_graphs.torch.cuda, "empty_cache", lambda: None)
    engine = llm.engine
    got = cuda_graphs.capture_decode_graphs(engine.model, engine.kv_cache, engine.kernels, engine.device, 4,
                                            engine.runner.buffer.block_table.shape[1])
    assert got is None and "CUDA graphs off, every step runs eagerly" in caplog.text
