"""router.registry: registration, load reports, liveness by heartbeat deadline, readiness."""

from __future__ import annotations

import pytest

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import Heartbeat, RegisterWorker, WorkerLoad, WorkerRole
from router.registry import WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reg(worker_id="w0", role=WorkerRole.PREFILL_AND_DECODE, pid=1, endpoint=None) -> RegisterWorker:
    return RegisterWorker(worker_id=worker_id, role=role, model_name="m", max_length=128, page_size=16,
                          num_total_blocks=32, prefill_endpoint=endpoint, pid=pid)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def dead(clock):
    return []


@pytest.fixture
def registry(clock, dead):
    return WorkerRegistry(heartbeat_interval_s=0.5, dead_after_s=3.0, on_worker_dead=dead.append, clock=clock)


def test_register_and_heartbeat_update_load(registry):
    info = registry.register(reg())
    assert info.role is PipelineRole.PrefillAndDecode and info.load.num_free_blocks == 32
    load = WorkerLoad(num_running=3, num_free_blocks=20, num_used_blocks=12, num_total_blocks=32)
    assert registry.heartbeat(Heartbeat(worker_id="w0", load=load)).load == load
    assert registry.heartbeat(Heartbeat(worker_id="nobody", load=load)) is None


def advance(registry, clock, seconds: float, every: float = 0.25) -> list:
    """Move the clock on as the router's housekeeping loop would, checking liveness every ``every`` s."""
    newly_dead = []
    for _ in range(round(seconds / every)):
        clock.now += every
        newly_dead += registry.check_liveness()
    return newly_dead


def test_silent_worker_is_declared_dead_once(registry, clock, dead):
    registry.register(reg())
    registry.check_liveness()
    assert advance(registry, clock, 3.0) == [] and registry.is_alive("w0")
    assert [w.worker_id for w in advance(registry, clock, 0.25)] == ["w0"]
    assert not registry.is_alive("w0") and [w.worker_id for w in dead] == ["w0"]
    assert advance(registry, clock, 10) == [] and len(dead) == 1
    assert registry.live_workers() == [] and len(registry.all_workers()) == 1


def test_a_worker_that_said_it_was_draining_stops_without_a_fault_in_the_log(registry, clock, dead, caplog):
    registry.register(reg("going"))
    registry.register(reg("lost", pid=2))
    registry.check_liveness()
    registry.heartbeat(Heartbeat(worker_id="going", load=WorkerLoad(num_total_blocks=32, is_draining=True)))
    with caplog.at_level("INFO", logger="router.registry"):
        advance(registry, clock, 3.5)
    assert sorted(w.worker_id for w in dead) == ["going", "lost"]  # both are gone from the routing all the same
    said = {r.getMessage().split()[1]: (r.levelname, r.getMessage()) for r in caplog.records}
    assert said["going"][0] == "INFO" and "drained and stopped" in said["going"][1]
    assert said["lost"][0] == "WARNING" and "declared dead" in said["lost"][1]


def test_heartbeats_keep_a_worker_alive_and_revive_a_dead_one(registry, clock):
    registry.register(reg())
    for _ in range(10):
        assert advance(registry, clock, 1.0) == []
        registry.heartbeat(Heartbeat(worker_id="w0", load=WorkerLoad(busy_in_step_s=12.0)))  # busy is not dead
    advance(registry, clock, 5)
    assert not registry.is_alive("w0")
    registry.touch("w0")
    assert registry.is_alive("w0")


def test_a_router_that_was_itself_stalled_declares_nobody_dead(registry, clock, dead, caplog):
    registry.register(reg())
    registry.check_liveness()
    clock.now += 4.0  # the router's event loop did not run: heartbeats may be waiting on its socket
    with caplog.at_level("WARNING", logger="router.registry"):
        assert registry.check_liveness() == [] and registry.is_alive("w0")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "4.0 s after the previous one" in said and "declared dead" not in said  # an operator grepping for deaths finds none here
    registry.heartbeat(Heartbeat(worker_id="w0", load=WorkerLoad()))  # read on the next turn
    assert advance(registry, clock, 1.0) == [] and dead == []
    assert [w.worker_id for w in advance(registry, clock, 2.5)] == ["w0"]  # silent for real now


def test_reregistration_with_a_new_pid_is_a_restart(registry, dead):
    registry.register(reg(pid=1)).num_inflight = 4
    registry.register(reg(pid=1))  # same process again: not a death, counts kept
    assert dead == [] and registry.get("w0").num_inflight == 4
    registry.register(reg(pid=2))
    assert [w.pid for w in dead] == [1]
    assert registry.is_alive("w0") and registry.get("w0").pid == 2 and registry.get("w0").num_inflight == 0


def test_readiness_needs_a_servable_role_mix(registry, clock):
    assert registry.readiness() == (False, "no live workers")
    registry.register(reg("d0", WorkerRole.DECODE_ONLY))
    ready, why = registry.readiness()
    assert ready and "prefilling locally" in why  # a DecodeOnly worker alone prefills itself
    registry.register(reg("p0", WorkerRole.PREFILL_ONLY, endpoint="ipc:///tmp/x"))
    assert registry.readiness()[0]
    clock.now += 5
    registry.check_liveness()
    registry.register(reg("p1", WorkerRole.PREFILL_ONLY, endpoint="ipc:///tmp/y"))
    ready, why = registry.readiness()
    assert not ready and "decode-capable" in why
    registry.register(reg("c0"))
    assert registry.readiness()[0]


def test_bad_timing_is_rejected():
    with pytest.raises(ValueError, match="dead_after_s"):
        WorkerRegistry(heartbeat_interval_s=1.0, dead_after_s=0.5)
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        WorkerRegistry(heartbeat_interval_s=0, dead_after_s=3.0)


def test_a_worker_dead_past_forget_after_s_is_forgotten_and_must_register_anew(clock, dead):
    forgotten = []
    registry = WorkerRegistry(heartbeat_interval_s=0.5, dead_after_s=3.0, on_worker_dead=dead.append, clock=clock,
                              forget_after_s=60.0, on_worker_forgotten=forgotten.append)
    registry.register(reg("gone"))
    registry.register(reg("here", pid=2))
    registry.check_liveness()
    for _ in range(70):
        advance(registry, clock, 1.0)
        registry.heartbeat(Heartbeat(worker_id="here", load=WorkerLoad()))
    assert [w.worker_id for w in dead] == ["gone"]
    assert [w.worker_id for w in registry.all_workers()] == ["here"]  # listed no more (/ready, metrics)
    assert forgotten == ["gone"]  # the router drops its per-worker request series
    assert registry.heartbeat(Heartbeat(worker_id="gone", load=WorkerLoad())) is None  # the router asks it to register
    assert registry.touch("gone") is None
    registry.register(reg("gone", pid=3))
    assert registry.is_alive("gone")
    with pytest.raises(ValueError, match="forget_after_s"):
        WorkerRegistry(heartbeat_interval_s=0.5, dead_after_s=3.0, forget_after_s=0)


def test_a_registration_is_due_in_a_new_routers_first_seconds_and_after_a_strangers_heartbeat(registry, clock):
    """A restarted router has its cluster's workers register again within a heartbeat or two: a request that
    nobody can serve meanwhile waits that long (``Dispatcher.submit``) instead of a 503."""
    assert registry.registration_due_s() == 3.0  # dead_after_s from the router's start
    clock.now += 3.5
    assert registry.registration_due_s() == 0.0  # a router started alone: no worker is coming
    assert registry.heartbeat(Heartbeat(worker_id="stranger", load=WorkerLoad())) is None  # asked to register
    assert registry.registration_due_s() == 3.0
    clock.now += 1.0
    assert registry.registration_due_s() == 2.0
