"""``tandem up``'s tensor-parallel flags: each worker's rank count, and P/D roles with several ranks refused
by name before anything starts (their KV would need the cross-layout transfer, not built yet)."""

from __future__ import annotations

import pytest

from deploy.cli import main
from deploy.tensor_parallel_plan import worker_tensor_parallel_sizes


def test_colocated_workers_take_the_tensor_parallel_size():
    assert worker_tensor_parallel_sizes(0, 0, 2, 2) == {"colocated-0": 2, "colocated-1": 2}
    # the P/D flags apply to their roles only; a role with no workers is not checked
    assert worker_tensor_parallel_sizes(0, 0, 1, 1, prefill_size=4, decode_size=2) == {"colocated-0": 1}
    assert worker_tensor_parallel_sizes(1, 1, 1, 2, prefill_size=1, decode_size=1) == {
        "prefill-0": 1, "decode-0": 1, "colocated-0": 2}


@pytest.mark.parametrize("counts, sizes, message", [
    ((1, 1, 0), (2, None, None), "--tensor-parallel-size 2 with 1 prefill worker: a PrefillOnly worker"),
    ((1, 1, 0), (1, 2, None), "--prefill-tensor-parallel-size 2 with 1 prefill worker: a PrefillOnly worker"),
    ((0, 2, 0), (1, None, 2), "--decode-tensor-parallel-size 2 with 2 decode workers: a DecodeOnly worker"),
    ((0, 0, 1), (0, None, None), "--tensor-parallel-size: must be >= 1"),
    ((1, 1, 0), (1, None, 0), "--decode-tensor-parallel-size: must be >= 1"),
])
def test_what_cannot_run_is_refused_by_flag(counts, sizes, message):
    with pytest.raises(ValueError, match=message) as info:
        worker_tensor_parallel_sizes(*counts, *sizes)
    if "worker" in message:
        assert "cross-layout KV transfer" in str(info.value) and "not built yet" in str(info.value)


def test_tandem_up_refuses_before_starting_anything(capsys):
    assert main(["up", "--decode-tensor-parallel-size", "2", "--ready-timeout", "1"]) == 2
    error = capsys.readouterr().err
    assert "tandem up: error: --decode-tensor-parallel-size 2 with 1 decode worker" in error
    assert main(["up", "--colocated", "1", "--tensor-parallel-size", "0"]) == 2  # the config field's own check
    assert "tensor_parallel_size" in capsys.readouterr().err


def test_a_worker_of_a_prefill_or_decode_role_refuses_several_ranks(capsys):
    assert main(["worker", "--role", "DecodeOnly", "--tensor-parallel-size", "2"]) == 2
    assert "a DecodeOnly worker with tensor_parallel_size=2 needs the cross-layout KV transfer" in capsys.readouterr().err


class _Started(Exception):
    """Raised by the stand-in cluster: what tandem up would start, captured, nothing started."""


def test_tandem_up_gives_each_worker_its_ranks_and_each_rank_its_cores(monkeypatch):
    import deploy.local_launcher
    import pipeline.cpu_placement

    captured = {}

    def fake_cluster(**kwargs):
        captured.update(kwargs)
        raise _Started

    monkeypatch.setattr(deploy.local_launcher, "LocalCluster", fake_cluster)
    monkeypatch.setattr(pipeline.cpu_placement, "allowed_cores", lambda cpu_cores: [0, 1, 2, 3])  # a 4-core host
    with pytest.raises(_Started):
        main(["up", "--colocated", "2", "--tensor-parallel-size", "2"])
    assert captured["tensor_parallel_sizes"] == {}  # the shared config carries 2 to every worker
    assert captured["config"]["tensor_parallel_size"] == 2
    assert captured["cpu_plan"] == {"colocated-0": [0, 1], "colocated-1": [2, 3]}  # one core per rank
    with pytest.raises(_Started):  # P/D at 1 beside colocated workers at 2: their own flag, on their command line
        main(["up", "--prefill", "1", "--decode", "1", "--colocated", "1", "--tensor-parallel-size", "2",
              "--prefill-tensor-parallel-size", "1", "--decode-tensor-parallel-size", "1"])
    assert captured["tensor_parallel_sizes"] == {"prefill-0": 1, "decode-0": 1}
