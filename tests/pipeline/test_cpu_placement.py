"""CPU placement of a worker: the core list syntax, its validation in the config, and binding."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.config import ConfigError, PipelineConfig, build_config
from pipeline.core_list import format_core_list, parse_core_list
from pipeline.cpu_placement import (allowed_cores, apply_cpu_placement, bind_to_cores, describe_placement, rank_cores,
                                    rank_placement)


@pytest.mark.parametrize(
    "text, cores",
    [("0", [0]), ("0-3,6", [0, 1, 2, 3, 6]), ("6,0-3", [0, 1, 2, 3, 6]), ("1,1,0-1", [0, 1]), (" 0 , 2-3 ", [0, 2, 3]),
     ("5-5", [5])],
)
def test_parse_core_list(text, cores):
    assert parse_core_list(text) == cores


@pytest.mark.parametrize(
    "cores, text",
    [([0], "0"), ([0, 1, 2, 3, 6], "0-3,6"), ([6, 3, 2, 1, 0, 0], "0-3,6"), ([0, 2, 4], "0,2,4"), ([], "")],
)
def test_format_core_list(cores, text):
    assert format_core_list(cores) == text


@pytest.mark.parametrize(
    "value, message",
    [
        ("", "cpu_cores: empty core list"),
        ("0,,1", "cpu_cores: empty item in the core list"),
        ("3-1", "cpu_cores: descending range '3-1'; write '1-3'"),
        ("-1", "cpu_cores: '-1': core numbers are >= 0"),
        (-2, "cpu_cores: '-2': core numbers are >= 0"),
        ("cores", "cpu_cores: 'cores' is not a core number or range (Linux list syntax: '0-3,6')"),
        ("0-", "cpu_cores: '0-' is not a core number or range"),
        ("0-2:2", "cpu_cores: '0-2:2' is not a core number or range"),
        ("0-99999999", "cpu_cores: core 99999999 is out of range"),
        (True, "cpu_cores: Input should be a valid string"),
    ],
)
def test_bad_core_lists_name_the_field(value, message):
    with pytest.raises(ConfigError) as info:
        build_config({"cpu_cores": value})
    assert message in str(info.value)


def test_core_lists_from_flags_env_and_files_are_normalised():
    assert build_config({"cpu_cores": 3}).cpu_cores == "3"  # "--cpu-cores 3" arrives as a number
    assert build_config({"cpu_cores": "3,0-1,2"}).cpu_cores == "0-3"
    config = PipelineConfig.load(environ={"TANDEM_CPU_CORES": "0", "TANDEM_NUM_THREADS": "2"})
    assert (config.cpu_cores, config.num_threads) == ("0", 2)
    assert PipelineConfig().cpu_cores is None and PipelineConfig().num_threads is None
    with pytest.raises(ConfigError, match=r"num_threads: Input should be greater than or equal to 1 \(got 0\)"):
        build_config({"num_threads": 0})


@pytest.fixture
def restore_placement():
    """apply_cpu_placement binds this very process: give its threads their cores back afterwards."""
    cores, num_threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS")
    yield cores
    bind_to_cores(cores)
    torch.set_num_threads(num_threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


def test_apply_binds_every_thread_and_sets_torch_threads(restore_placement):
    first = restore_placement[0]
    assert apply_cpu_placement(build_config({"cpu_cores": str(first)})) == ([first], 1)
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    for task in os.listdir("/proc/self/task"):
        assert os.sched_getaffinity(int(task)) == {first}
    assert apply_cpu_placement(build_config({"cpu_cores": str(first), "num_threads": 2})) == ([first], 2)


def test_apply_without_cores_keeps_them_and_uses_one_thread_per_core(restore_placement):
    assert apply_cpu_placement(PipelineConfig()) == (restore_placement, len(restore_placement))
    assert sorted(os.sched_getaffinity(0)) == restore_placement


def test_a_core_this_process_may_not_use_is_named(restore_placement):
    missing = max(restore_placement) + 1
    with pytest.raises(ValueError) as info:
        allowed_cores(f"0,{missing}-{missing + 1}")
    assert str(info.value) == (f"cpu_cores: core {missing}-{missing + 1} not available to this process "
                               f"(available: {format_core_list(restore_placement)})")
    with pytest.raises(ValueError, match=f"core {missing} not available"):
        apply_cpu_placement(build_config({"cpu_cores": str(missing)}))
    assert sorted(os.sched_getaffinity(0)) == restore_placement  # nothing was bound


def test_describe_placement():
    assert describe_placement([0, 1], 2) == "cores 0-1, 2 torch threads"
    assert describe_placement([3], 1) == "cores 3, 1 torch thread"


@pytest.mark.parametrize("cores, num_ranks, shares", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2], 2, [[0, 1], [2]]),  # the first ranks get the extra core
    (list(range(8)), 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ([4, 9], 1, [[4, 9]]),
    ([0], 2, [[0], [0]]),  # fewer cores than ranks: shared, round-robin
    ([0, 1], 3, [[0], [1], [0]]),
])
def test_rank_cores_give_each_rank_its_own_share(cores, num_ranks, shares):
    assert rank_cores(cores, num_ranks) == shares


def test_rank_placement_binds_ranks_only_when_the_worker_has_cores(restore_placement):
    named = build_config({"cpu_cores": "0-2", "tensor_parallel_size": 2})
    assert [rank_placement(named, rank) for rank in (0, 1)] == [([0, 1], 2), ([2], 1)]
    threads = build_config({"cpu_cores": "0-2", "tensor_parallel_size": 2, "num_threads": 3})
    assert rank_placement(threads, 1) == ([2], 3)  # num_threads is each rank's
    unbound = build_config({"tensor_parallel_size": 2})
    assert rank_placement(unbound, 1) == (None, len(rank_cores(restore_placement, 2)[1]))


def test_apply_binds_rank_zero_to_its_share(restore_placement):
    if len(restore_placement) < 2:
        pytest.skip("needs two cores")
    first, second = restore_placement[:2]
    config = build_config({"cpu_cores": f"{first},{second}", "tensor_parallel_size": 2})
    assert apply_cpu_placement(config) == ([first], 1)  # rank 1 takes the other core when it starts
    assert os.sched_getaffinity(0) == {first}
