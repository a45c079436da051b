"""The persistent batch: rows that live across steps give the same flat batch as building it from scratch."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.protocol import SamplingParams
from pipeline.sequence import PLACEHOLDER_TOKEN_ID, Sequence
from pipeline.sequence_buffer import SequenceBuffer

PAGE = 4


def seq(request_id: str, prompt: list[int]) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=8), max_total_tokens=64)


def naive(seqs_and_tables, starts, lengths):
    """The flat batch from Python lists, as the runner built it before the buffer existed."""
    input_ids, positions, slots, tables = [], [], [], []
    for (s, table), start, length in zip(seqs_and_tables, starts, lengths):
        input_ids += s.token_ids[start:start + length]
        positions += list(range(start, start + length))
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(start, start + length)]
        tables.append(table)
    width = max(len(t) for t in tables)
    return input_ids, positions, slots, [t + [0] * (width - len(t)) for t in tables]


def test_gather_matches_the_list_build_across_steps():
    buffer = SequenceBuffer(max_num_reqs=4, max_model_len=32, page_size=PAGE)
    a, b = seq("a", list(range(10, 19))), seq("b", [5, 6])
    tables = {"a": [7, 3, 9], "b": [2]}
    b.append_token(40)
    # step 1: a's first prompt chunk beside b's whole prompt (and the token b already has)
    rows = [buffer.sync(s, tables[s.request_id]) for s in (a, b)]
    got = buffer.gather(rows, [0, 0], [6, 3])
    want = naive([(a, tables["a"]), (b, tables["b"])], [0, 0], [6, 3])
    assert got.input_ids.tolist() == want[0] and got.positions.tolist() == want[1]
    assert got.slot_mapping.tolist() == want[2] and got.block_tables.tolist() == want[3]
    assert got.cu_seqlens.tolist() == [0, 6, 9] and got.context_lens.tolist() == [6, 3]
    # next step: a finishes its prompt, b decodes its new token in a freshly grown block
    a.append_token(77)
    b.append_token(41)
    tables["b"] = [2, 11]
    rows = [buffer.sync(s, tables[s.request_id]) for s in (a, b)]
    got = buffer.gather(rows, [6, 3], [3, 1])
    want = naive([(a, tables["a"]), (b, tables["b"])], [6, 3], [3, 1])
    assert (got.input_ids.tolist(), got.positions.tolist(), got.slot_mapping.tolist()) == want[:3]
    assert got.block_tables.tolist() == [[7, 3, 9], [2, 11, 0]]  # padding is block 0, never a stale id


def test_rows_stay_contiguous_and_survive_condense():
    buffer = SequenceBuffer(max_num_reqs=3, max_model_len=16, page_size=PAGE)
    seqs = [seq(f"r{i}", [i + 1] * (i + 2)) for i in range(3)]
    for i, s in enumerate(seqs):
        assert buffer.sync(s, [i]) == i
    with pytest.raises(RuntimeError, match="full"):
        buffer.add_request("extra")
    row = buffer.remove_request("r0")
    buffer.condense([row])
    assert buffer.num_reqs == 2 and buffer.row_of("r2") == 0 and buffer.row_of("r1") == 1
    got = buffer.gather([buffer.row_of("r2"), buffer.row_of("r1")], [0, 0], [4, 3])
    assert got.input_ids.tolist() == [3, 3, 3, 3, 2, 2, 2]
    assert buffer.remove_request("missing") is None


def test_placeholders_are_rewritten_once_known_and_a_new_owner_starts_over():
    buffer = SequenceBuffer(max_num_reqs=2, max_model_len=16, page_size=PAGE)
    s = seq("a", [1, 2, 3])
    s.append_token(PLACEHOLDER_TOKEN_ID)  # overlap: sampled, not read yet
    row = buffer.sync(s, [0])
    assert buffer.gather([row], [3], [1]).input_ids.tolist() == [PLACEHOLDER_TOKEN_ID]
    s.fill_token(3, 42)
    s.append_token(PLACEHOLDER_TOKEN_ID)
    row = buffer.sync(s, [0, 1])
    assert buffer.gather([row], [0], [5]).input_ids.tolist() == [1, 2, 3, 42, PLACEHOLDER_TOKEN_ID]
    # preempted and readmitted with other blocks: the row is rebuilt, not extended
    s.fill_token(4, 43)
    s.num_preemptions += 1
    row = buffer.sync(s, [5, 6])
    got = buffer.gather([row], [0], [5])
    assert got.input_ids.tolist() == [1, 2, 3, 42, 43] and got.block_tables.tolist() == [[5, 6]]
    # the same request id reused by a new request
    new = seq("a", [9, 9])
    row = buffer.sync(new, [8])
    assert buffer.gather([row], [0], [2]).input_ids.tolist() == [9, 9]
    assert np.array_equal(buffer.gather([row], [0], [2]).block_tables, [[8]])


def test_sampling_arrays_from_rows_equal_those_read_from_the_states():
    import torch

    from pipeline.sampler import SequenceSamplingState
    from pipeline.sampling_metadata import build_sampling_metadata

    buffer = SequenceBuffer(max_num_reqs=4, max_model_len=16, page_size=PAGE, vocab_size=50)
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, frequency_penalty=0.3),
              SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=1.3, top_k=500, presence_penalty=0.5)]
    seqs = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", [1, 2, 3], p, max_total_tokens=16)
        s.sampling_state = SequenceSamplingState(params=p, prompt_token_ids=s.prompt_token_ids, output_token_ids=[4])
        seqs.append(s)
    rows = [buffer.sync(s, [0]) for s in reversed(seqs)][::-1]  # rows in another order than the batch
    states = [s.sampling_state for s in seqs]
    from_rows = build_sampling_metadata(states, 50, torch.device("cpu"), buffer.sampling_arrays(rows))
    from_states = build_sampling_metadata(states, 50, torch.device("cpu"))
    for name in ("random_rows", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty"):
        assert torch.equal(getattr(from_rows, name), getattr(from_states, name)), name
    assert from_rows.max_top_k == from_states.max_top_k == 50 and from_rows.top_k.tolist() == [5, 50]
