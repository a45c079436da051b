"""`tandem ray up` with tensor-parallel workers, decided before Ray is touched: each worker's placement group
(one bundle, a CPU per rank), the refusals that name the flag, and the cores each group holds on its node."""

from __future__ import annotations

import pytest

from deploy import ray_cmd, tensor_parallel_plan
from deploy.cli import build_parser, main
from deploy.ray_cluster import spec
from deploy.ray_cluster.rank_groups import check_fits, reserve_cores, worker_bundle
from deploy.ray_cluster.spec import ProcessSpec
from pipeline.cpu_placement import rank_cores


def test_a_worker_of_n_ranks_reserves_one_bundle_of_n_cpus():
    assert worker_bundle("colocated-0", {}, 2) == {"CPU": 2.0}
    assert worker_bundle("decode-0", {"decode": 1.0, "CPU": 6.0}, 4) == {"decode": 1.0, "CPU": 6.0}  # asked for more
    assert worker_bundle("colocated-0", {"GPU": 2.0}, 2) == {"GPU": 2.0, "CPU": 2.0}  # a GPU per rank (cuda:r)
    for gpus in (1.0, 1.5):
        with pytest.raises(ValueError, match="--tensor-parallel-size 2: each rank needs a whole GPU"):
            worker_bundle("colocated-0", {"GPU": gpus}, 2)
    with pytest.raises(ValueError, match="^--prefill-tensor-parallel-size / --tensor-parallel-size 2: each rank"):
        worker_bundle("prefill-0", {"GPU": 1.0}, 2)


def test_a_group_no_node_can_hold_is_refused_naming_the_flag():
    nodes = [{"CPU": 2.0, "memory": 1e9}, {"CPU": 4.0, "decode": 1.0}]
    check_fits({"colocated-0": {"CPU": 4.0}, "decode-0": {"CPU": 4.0, "decode": 1.0}}, nodes)
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size: colocated-0 runs its ranks on one node .*"
                                         r"\{CPU: 8\}.* largest has 4 CPUs"):
        check_fits({"colocated-0": {"CPU": 8.0}}, nodes)
    with pytest.raises(ValueError, match="^--decode-tensor-parallel-size / --tensor-parallel-size: decode-0 runs"):
        check_fits({"decode-0": {"CPU": 2.0, "decode": 2.0}}, nodes)  # enough CPUs, but not on a decode node


def test_a_group_gets_as_many_cores_of_its_own_as_it_holds():
    plan, left = reserve_cores([0, 1, 2, 3, 4, 5, 6, 7], {"colocated-0": 2, "prefill-0": 3, "decode-1": 2})
    assert plan == {"prefill-0": [0, 1, 2], "colocated-0": [6, 7], "decode-1": [4, 5]} and left == [3]
    with pytest.raises(ValueError, match="hold 3 CPUs on one node whose pool has 2 cores"):
        reserve_cores([0, 1], {"colocated-0": 3})


def test_node_plan_keeps_the_held_cores_apart_and_splits_the_rest_as_tandem_up():
    cores = list(range(8))
    where = {name: {"node_id": "a", "cores": cores} for name in ("router", "prefill-0", "decode-0", "colocated-0")}
    plan = spec.plan_node_cores(where, held={"colocated-0": 4})
    assert plan["colocated-0"] == [4, 5, 6, 7]  # one core per rank: [[4], [5], [6], [7]]
    assert rank_cores(plan["colocated-0"], 4) == [[4], [5], [6], [7]]
    assert plan["prefill-0"] == [0, 1] and plan["decode-0"] == [2, 3]  # tandem up's split of what is left
    assert plan["router"] == [0, 1]
    # the test machine's case: one TP 2 worker on a 2-CPU node gets one core per rank
    two = spec.plan_node_cores({"router": {"node_id": "h", "cores": [0, 1]},
                                "colocated-0": {"node_id": "h", "cores": [0, 1]}}, held={"colocated-0": 2})
    assert two["colocated-0"] == [0, 1] and two["router"] == [0, 1]
    # nothing left for the others: they share the whole pool
    full = spec.plan_node_cores({n: {"node_id": "h", "cores": [0, 1]} for n in ("colocated-0", "colocated-1")},
                                held={"colocated-0": 2})
    assert full == {"colocated-0": [0, 1], "colocated-1": [0, 1]}
    # a pool smaller than the groups (cpu_cores, or Ray counting more CPUs than cores): tandem up's plan, ranks counted
    small = spec.plan_node_cores({"colocated-0": {"node_id": "h", "cores": [0, 1, 2]}}, pool_limit=[0],
                                 held={"colocated-0": 2})
    assert small == {"colocated-0": [0]}
    shared = spec.plan_node_cores(where, share=True, held={"colocated-0": 4})
    assert all(cores_ == cores for cores_ in shared.values())


def test_a_worker_whose_size_differs_from_the_config_gets_the_flag():
    assert ProcessSpec("t", "colocated-0", {}, "/l", 1, num_ranks=2).cli_args("x")[-2:] == ["--tensor-parallel-size", "2"]
    same = ProcessSpec("t", "colocated-0", {"tensor_parallel_size": 2}, "/l", 1, num_ranks=2)
    assert "--tensor-parallel-size" not in same.cli_args("x")


def up_options(argv: list[str]):
    args = build_parser().parse_args(["ray", "up", *argv])
    return ray_cmd._up_options(args)


def test_ray_up_gives_every_worker_the_ranks_its_flags_ask_for(monkeypatch):
    monkeypatch.setattr(tensor_parallel_plan, "tensor_parallel_role_error", lambda *a, **k: None)  # every role may
    options = up_options(["--colocated", "2", "--tensor-parallel-size", "2"])
    assert options.num_ranks == {"colocated-0": 2, "colocated-1": 2}
    assert up_options(["--colocated", "1"]).num_ranks == {}
    assert up_options(["--prefill", "1", "--decode", "2", "--tensor-parallel-size", "2"]).num_ranks == {
        "prefill-0": 2, "decode-0": 2, "decode-1": 2}
    assert up_options(["--prefill", "1", "--decode", "1", "--prefill-tensor-parallel-size", "2"]).num_ranks == {
        "prefill-0": 2}


def test_ray_up_refuses_what_the_config_refuses_a_role_naming_the_flag(monkeypatch, capsys):
    """Which roles may run several ranks is pipeline.config's rule (tensor_parallel_role_error), not ray up's."""
    seen = []

    def refuse_decode(role, size, device, transport):
        seen.append((role.value, size, device, transport))
        return None if role.value != "DecodeOnly" or size == 1 else "tensor_parallel_size: not on DecodeOnly"

    monkeypatch.setattr(tensor_parallel_plan, "tensor_parallel_role_error", refuse_decode)
    assert main(["ray", "up", "--prefill", "1", "--decode", "1", "--decode-tensor-parallel-size", "2"]) == 2
    assert "--decode-tensor-parallel-size 2 with 1 decode worker: not on DecodeOnly" in capsys.readouterr().err
    assert ("DecodeOnly", 2, "auto", "auto") in seen  # judged with the config's device and KV transport
