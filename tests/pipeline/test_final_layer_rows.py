"""Only the sampled rows leave the last decoder layer (``ForwardBatch.final_layer``): every family returns the
same hidden states at those rows as the full forward and writes the same KV cache, with either kernel set; the
model runner trims exactly the steps where no other row is read (no prompt logprobs)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pipeline import LLM, SamplingParams
from pipeline import model_runner as model_runner_module
from pipeline.forward_batch import ForwardBatch, with_final_layer_rows
from pipeline.weights import load_model
from tests.conftest import ARCHITECTURES
from tests.deepseek_checkpoints import deepseek_checkpoint  # noqa: F401 (a fixture)
from tests.gemma_checkpoints import gemma3_checkpoint  # noqa: F401 (a fixture)
from tests.gpt_oss_checkpoints import gpt_oss_checkpoint  # noqa: F401 (a fixture)
from tests.moe_checkpoints import moe_checkpoint  # noqa: F401 (a fixture)
from tests.pipeline.test_models import KERNELS, PagedSequences, random_tokens

# family -> (the fixture that builds it, its name there)
FAMILIES = {**{arch: ("tiny_checkpoint", arch) for arch in ARCHITECTURES},
            "qwen3_moe": ("moe_checkpoint", "qwen3_moe"), "mixtral": ("moe_checkpoint", "mixtral"),
            "gemma3": ("gemma3_checkpoint", "gemma3"), "gpt_oss": ("gpt_oss_checkpoint", "gpt_oss"),
            "deepseek_v3": ("deepseek_checkpoint", "deepseek_v3")}


def host(batch: ForwardBatch, name: str) -> np.ndarray:
    return getattr(batch, name).numpy()


def trimmed(batch: ForwardBatch, rows: list[int]) -> ForwardBatch:
    rows_array = np.asarray(rows, dtype=np.int64)
    batch = ForwardBatch(**{**vars(batch), "logits_indices": torch.from_numpy(rows_array)})
    return with_final_layer_rows(batch, host(batch, "cu_seqlens_q"), host(batch, "context_lens"),
                                 host(batch, "block_tables"), rows_array, torch.from_numpy)


def test_the_final_layer_batch_keeps_each_sequences_last_rows():
    cu = np.array([0, 5, 6, 9, 13], dtype=np.int32)  # four sequences of 5, 1, 3 and 4 rows
    batch = ForwardBatch(input_ids=torch.zeros(13, dtype=torch.int64), positions=torch.arange(13),
                         cu_seqlens_q=torch.from_numpy(cu), context_lens=torch.tensor([5, 8, 3, 20], dtype=torch.int32),
                         slot_mapping=torch.arange(13), block_tables=torch.arange(8, dtype=torch.int32).view(4, 2),
                         logits_indices=torch.tensor([4, 5, 11, 12]))
    final = trimmed(batch, [4, 5, 11, 12]).final_layer  # the third sequence (a prompt's first chunk) samples nothing
    assert final.query_rows.tolist() == [4, 5, 11, 12]
    assert final.cu_seqlens_q.tolist() == [0, 1, 2, 4]
    assert final.context_lens.tolist() == [5, 8, 20]
    assert final.block_tables.tolist() == [[0, 1], [2, 3], [6, 7]]
    assert final.input_ids is batch.input_ids and final.slot_mapping is batch.slot_mapping  # K/V of every row
    for rows in ([3, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 4]):  # not a suffix; all; unsorted
        assert trimmed(batch, rows).final_layer is None
    cache_only = trimmed(batch, [])  # a step that samples nothing: the first sequence's last row stands in
    assert cache_only.final_layer.query_rows.tolist() == [4] and cache_only.final_layer.cu_seqlens_q.tolist() == [0, 1]
    assert cache_only.sampled_rows(torch.ones(1, 8)).shape == (0, 8)
    arrays = trimmed(batch, [4, 5, 11, 12]).to_arrays()  # how a tensor-parallel step travels to the other ranks
    again = ForwardBatch.from_arrays(arrays, "cpu")
    assert again.final_layer.query_rows.tolist() == [4, 5, 11, 12] and again.final_layer.final_layer is None
    assert again.cu_seqlens_q.tolist() == cu.tolist() and again.query_rows is None
    assert set(arrays["final_layer"]) == {"cu_seqlens_q", "context_lens", "block_tables", "query_rows"}  # sent once
    assert again.final_layer.input_ids is again.input_ids and again.final_layer.slot_mapping is again.slot_mapping


@pytest.fixture(scope="module")
def models(request):
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str, backend: str):
        if (name, backend) not in cache:
            fixture, checkpoint_name = FAMILIES[name]
            model, _ = load_model(request.getfixturevalue(fixture)(checkpoint_name), torch.float32, "cpu")
            KERNELS[backend].prepare_model(model)
            cache[name, backend] = model
        return cache[name, backend]

    return get


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_sampled_rows_and_the_cache_match_the_full_forward(name, backend, models):
    model = models(name, backend)
    vocab = model.hf_config.vocab_size
    full_paged = PagedSequences(model, num_seqs=4, max_len=40, seed=3)
    trim_paged = copy.deepcopy(full_paged)
    # the rows each step samples, by the flat offsets where its sequences end
    steps = [  # first chunks sampling nothing; prompts (the fourth's chunk samples nothing); chunks beside decodes
        ([random_tokens(vocab, n, seed=n) for n in (4, 0, 0, 5)], lambda ends: []),
        ([random_tokens(vocab, n, seed=10 + n) for n in (5, 1, 6, 7)], lambda ends: [e - 1 for e in ends[:3]]),
        ([random_tokens(vocab, n, seed=20 + n) for n in (1, 3, 1, 14)],  # three of the second: a verify's rows
         lambda ends: [ends[0] - 1, ends[1] - 3, ends[1] - 2, ends[1] - 1, ends[2] - 1, ends[3] - 1]),
    ]
    for new_tokens, sampled in steps:
        full_batch, trim_batch = full_paged.step(new_tokens), trim_paged.step(new_tokens)
        rows = sampled(full_batch.cu_seqlens_q.tolist()[1:])
        trim_batch = trimmed(trim_batch, rows)
        kept_rows = trim_batch.final_layer.query_rows.tolist()
        assert kept_rows == (rows or [full_batch.cu_seqlens_q.tolist()[1] - 1])  # a stand-in where none is sampled
        with torch.inference_mode():
            full = model(full_batch, full_paged.kv_cache, KERNELS[backend])  # [num_tokens, hidden]
            kept = model(trim_batch, trim_paged.kv_cache, KERNELS[backend])  # [len(kept_rows), hidden]
        assert kept.shape == (len(kept_rows), full.shape[1])
        torch.testing.assert_close(kept, full[kept_rows], atol=2e-5, rtol=1e-5)
        assert torch.equal(trim_batch.sampled_rows(kept), kept[:len(rows)])
        assert torch.equal(trim_paged.kv_cache, full_paged.kv_cache)  # every row's K/V, in every layer


def test_the_runner_trims_steps_that_read_only_their_sampled_rows(tiny_checkpoint, hf_reference, monkeypatch):
    """Exactness through the engine is every engine test's; here: which steps trim, and prompt logprobs still
    score every prompt row (against transformers)."""
    seen: list[bool] = []
    to_batch = model_runner_module.ModelRunner.to_batch

    def recording(self, gathered, chunks):
        batch = to_batch(self, gathered, chunks)
        seen.append(batch.final_layer is not None)
        return batch

    monkeypatch.setattr(model_runner_module.ModelRunner, "to_batch", recording)
    path = tiny_checkpoint("llama")
    llm = LLM(model=path, model_config={"dtype": "float32", "device": "cpu"})
    prompt = random_tokens(300, 12, seed=1)
    llm.generate([prompt], [SamplingParams(max_tokens=3, temperature=0.0)])
    assert seen == [True, False, False]  # the prompt's step; decodes sample every row
    seen.clear()
    chunked = LLM(model=path, model_config={"dtype": "float32", "device": "cpu"}, max_batch_input_tokens=5)
    assert chunked.generate([prompt], [SamplingParams(max_tokens=2, temperature=0.0)])[0].token_ids == \
        llm.generate([prompt], [SamplingParams(max_tokens=2, temperature=0.0)])[0].token_ids
    assert seen[:4] == [True, True, True, False]  # chunks of 5, 5 (sampling nothing) and 2 rows; a decode
    seen.clear()
    seen.clear()
    out = llm.generate([prompt], [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)])[0]
    assert seen == [False]
    hf_model, _ = hf_reference(path)
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    got = [entry[prompt[i + 1]] for i, entry in enumerate(out.prompt_logprobs[1:])]
    want = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert np.allclose(got, want, atol=1e-4)
