"""``tandem up``'s tensor-parallel flags: each worker's rank count per role, and what a role cannot run with several
ranks (a size below 1; prefill and decode workers on GPUs, or forced onto the in-place shm transport) refused by
name before anything starts."""

from __future__ import annotations

import pytest

from deploy.cli import main
from deploy.tensor_parallel_plan import worker_tensor_parallel_sizes


def test_each_role_takes_its_tensor_parallel_size():
    assert worker_tensor_parallel_sizes(0, 0, 2, 2) == {"colocated-0": 2, "colocated-1": 2}
    # the P/D flags apply to their roles only, and a role with no workers cannot be given one (it would do nothing)
    with pytest.raises(ValueError, match=r"--prefill-tensor-parallel-size 4: there is no prefill worker to run it"):
        worker_tensor_parallel_sizes(0, 0, 1, 1, prefill_size=4, decode_size=2)
    assert worker_tensor_parallel_sizes(0, 1, 1, 1, decode_size=2) == {"decode-0": 2, "colocated-0": 1}
    assert worker_tensor_parallel_sizes(1, 1, 1, 2, prefill_size=1, decode_size=1) == {
        "prefill-0": 1, "decode-0": 1, "colocated-0": 2}
    assert worker_tensor_parallel_sizes(1, 2, 0, 1, prefill_size=2) == {"prefill-0": 2, "decode-0": 1, "decode-1": 1}
    assert worker_tensor_parallel_sizes(1, 1, 0, 2) == {"prefill-0": 2, "decode-0": 2}


@pytest.mark.parametrize("counts, sizes, options, message", [
    ((1, 1, 0), (2, None, None), {"device": "cuda"}, "--tensor-parallel-size 2 with 1 prefill worker: a PrefillOnly "
                                                      "worker with tensor_parallel_size=2 runs on CPU only"),
    ((0, 2, 0), (1, None, 2), {"transport": "shm"}, "--decode-tensor-parallel-size 2 with 2 decode workers: "
                                                    "transfer.transport: 'shm' writes one cache in place"),
    ((0, 0, 1), (0, None, None), {}, "--tensor-parallel-size: must be >= 1"),
    ((1, 1, 0), (1, None, 0), {}, "--decode-tensor-parallel-size: must be >= 1"),
])
def test_what_cannot_run_is_refused_by_flag(counts, sizes, options, message):
    with pytest.raises(ValueError, match=message):
        worker_tensor_parallel_sizes(*counts, *sizes, **options)
    if options:  # the same sizes on a colocated worker run
        assert worker_tensor_parallel_sizes(0, 0, 1, max(s or 1 for s in sizes), **options)


def test_tandem_up_refuses_before_starting_anything(capsys):
    assert main(["up", "--decode-tensor-parallel-size", "2", "--transfer-transport", "shm", "--ready-timeout", "1"]) == 2
    error = capsys.readouterr().err
    assert "tandem up: error:" in error and "transfer.transport: 'shm' writes one cache in place" in error
    assert main(["up", "--colocated", "1", "--tensor-parallel-size", "0"]) == 2  # the config field's own check
    assert "tensor_parallel_size" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--prefill-tensor-parallel-size", "3"], "PrefillOnly workers of 3 ranks: tensor_parallel_size=3 must divide "
                                              "num_attention_heads=4"),
    (["--tensor-parallel-size", "2", "--speculative-num-speculative-tokens", "2"],
     "DecodeOnly workers of 2 ranks: tensor_parallel_size=2 with speculative decoding needs a draft checkpoint"),
])
def test_tandem_up_refuses_what_the_checkpoint_cannot_split_before_starting_anything(flags, message, tiny_checkpoint,
                                                                                    capsys, monkeypatch):
    import deploy.local_launcher

    monkeypatch.setattr(deploy.local_launcher, "LocalCluster", lambda **kwargs: pytest.fail("a cluster was started"))
    assert main(["up", "--prefill", "1", "--decode", "1", "--model", tiny_checkpoint("llama"), *flags]) == 2
    error = capsys.readouterr().err
    assert f"tandem up: error: {message}" in error and "Traceback" not in error


def test_a_worker_of_a_prefill_or_decode_role_refuses_what_its_ranks_cannot_run(capsys):
    assert main(["worker", "--role", "DecodeOnly", "--tensor-parallel-size", "2", "--transfer-transport", "shm"]) == 2
    assert "a DecodeOnly worker with tensor_parallel_size=2 moves its ranks' KV over 'zmq'" in capsys.readouterr().err


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
    with pytest.raises(_Started):  # P/D of different layouts: each its own ranks, each rank its own cores
        main(["up", "--prefill", "1", "--decode", "1", "--prefill-tensor-parallel-size", "2",
              "--decode-tensor-parallel-size", "1"])
    assert captured["tensor_parallel_sizes"] == {"prefill-0": 2}  # decode-0 takes the shared size, 1
    plan = captured["cpu_plan"]
    assert len(plan["prefill-0"]) >= 2 and len(plan["decode-0"]) >= 1 and not set(plan["prefill-0"]) & set(plan["decode-0"])
