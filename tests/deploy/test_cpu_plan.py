"""``tandem up``'s default core split: prefill and decode workers on disjoint cores, in proportion."""

from __future__ import annotations

import pytest

from deploy.cpu_plan import describe_plan, plan_cores, router_cores


@pytest.mark.parametrize(
    "available, counts, share, expected",
    [
        ([0, 1], (1, 1, 0), False, {"prefill-0": [0], "decode-0": [1]}),
        (list(range(16)), (1, 3, 0), False,
         {"prefill-0": [0, 1, 2, 3], "decode-0": [4, 5, 6, 7], "decode-1": [8, 9, 10, 11],
          "decode-2": [12, 13, 14, 15]}),
        ([0, 1], (2, 2, 0), False, {"prefill-0": [0], "prefill-1": [0], "decode-0": [1], "decode-1": [1]}),
        ([0, 1], (1, 2, 0), False, {"prefill-0": [0], "decode-0": [1], "decode-1": [1]}),
        ([0, 1, 2], (1, 1, 0), False, {"prefill-0": [0, 1], "decode-0": [2]}),  # a tie goes to prefill
        ([0, 1, 2, 3], (3, 1, 0), False, {"prefill-0": [0], "prefill-1": [1], "prefill-2": [2], "decode-0": [3]}),
        (list(range(8)), (1, 0, 1), False, {"prefill-0": [0, 1, 2, 3], "colocated-0": [4, 5, 6, 7]}),
        (list(range(8)), (2, 1, 1), False,
         {"prefill-0": [0, 1], "prefill-1": [2, 3], "decode-0": [4, 5], "colocated-0": [6, 7]}),
        ([0], (1, 1, 0), False, {"prefill-0": [0], "decode-0": [0]}),
        (list(range(8)), (0, 0, 1), False, {"colocated-0": list(range(8))}),
        (list(range(8)), (0, 0, 3), False, {"colocated-0": [0, 1, 2], "colocated-1": [3, 4, 5], "colocated-2": [6, 7]}),
        ([4, 5, 6, 7], (0, 2, 0), False, {"decode-0": [4, 5], "decode-1": [6, 7]}),
        ([2, 3, 8, 9], (1, 1, 0), True, {"prefill-0": [2, 3, 8, 9], "decode-0": [2, 3, 8, 9]}),
        ([3, 1, 2, 0], (1, 1, 0), False, {"prefill-0": [0, 1], "decode-0": [2, 3]}),  # any order in
    ],
)
def test_plan_cores(available, counts, share, expected):
    plan = plan_cores(available, *counts, share=share)
    assert plan == expected
    assert list(plan) == list(expected)  # in LocalCluster's worker order


def test_no_cores_is_an_error():
    with pytest.raises(ValueError, match="no CPU cores"):
        plan_cores([], 1, 1, 0)


def test_describe_plan_says_threads_and_warns_when_prefill_and_decode_share():
    assert (describe_plan({"prefill-0": [0], "decode-0": [1]})
            == "prefill-0: cores 0 (1 thread) | decode-0: cores 1 (1 thread)")
    assert (describe_plan({"prefill-0": [0, 1, 2, 3], "decode-0": [4, 5, 6, 7]}, num_threads=2)
            == "prefill-0: cores 0-3 (2 threads) | decode-0: cores 4-7 (2 threads)")
    one_core = describe_plan(plan_cores([0], 1, 1, 0))
    assert one_core.startswith("prefill-0: cores 0 (1 thread) | decode-0: cores 0 (1 thread) (warning: ")
    assert "prefill and decode workers share core 0;" in one_core
    assert "warning" in describe_plan(plan_cores([0, 1], 1, 1, 0, share=True))
    assert "warning" not in describe_plan(plan_cores([0, 1], 2, 2, 0))  # same-group sharing is fine


@pytest.mark.parametrize(
    "available, counts, share, expected",
    [
        ([0, 1], (1, 1, 0), False, [0]),  # beside prefill: the decode core is left to decode steps
        (list(range(8)), (1, 3, 0), False, [0, 1]),
        ([0, 1], (0, 0, 1), False, [0, 1]),  # colocated: wherever the worker runs
        ([0, 1], (1, 1, 0), True, [0, 1]),  # shared cores: no prefill cores of its own to sit beside
        ([0, 1], (0, 2, 0), False, [0, 1]),
    ],
)
def test_router_runs_beside_the_prefill_workers(available, counts, share, expected):
    assert router_cores(plan_cores(available, *counts, share=share)) == expected


@pytest.mark.parametrize(
    "available, counts, num_ranks, expected",
    [
        # 2 cores, a TP 2 worker beside a TP 1 one: a core per rank, the third rank shares (round-robin)
        ([0, 1], (0, 0, 2), {"colocated-0": 2}, {"colocated-0": [0, 1], "colocated-1": [0]}),
        ([0, 1, 2, 3], (0, 0, 2), {"colocated-0": 2}, {"colocated-0": [0, 1, 2], "colocated-1": [3]}),
        ([0, 1, 2, 3], (0, 0, 2), {"colocated-0": 2, "colocated-1": 2},
         {"colocated-0": [0, 1], "colocated-1": [2, 3]}),
        # ranks weigh in the prefill / decode split too
        (list(range(6)), (1, 1, 0), {"decode-0": 2}, {"prefill-0": [0, 1], "decode-0": [2, 3, 4, 5]}),
        ([0, 1], (0, 0, 1), {"colocated-0": 1}, {"colocated-0": [0, 1]}),
    ],
)
def test_plan_cores_counts_each_rank(available, counts, num_ranks, expected):
    plan = plan_cores(available, *counts, num_ranks=num_ranks)
    assert plan == expected and list(plan) == list(expected)


def test_describe_plan_lists_each_ranks_cores():
    ranks = {"colocated-0": 2}
    assert (describe_plan(plan_cores([0, 1], 0, 0, 2, num_ranks=ranks), num_ranks=ranks)
            == "colocated-0: cores 0-1 (rank 0: 0, 1 thread; rank 1: 1, 1 thread) | colocated-1: cores 0 (1 thread)")
