"""The restart policy without processes: a fake clock, fake exits, recorded restarts."""

from __future__ import annotations

import signal

import pytest

from deploy.supervisor import RestartPolicy, Supervisor, describe_exit


class FakeProcesses:
    """Processes as the supervisor sees them: an exit code (None while running) and a respawn count."""

    def __init__(self, names):
        self.exit_codes = {name: None for name in names}
        self.respawned: list[str] = []
        self.next_pid = 100
        self.fail_next_start = False

    def poll_exit(self, name):
        return self.exit_codes[name]

    def respawn(self, name):
        if self.fail_next_start:
            self.fail_next_start = False
            raise OSError("no such file")
        self.exit_codes[name] = None
        self.respawned.append(name)
        self.next_pid += 1
        return self.next_pid


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make(names=("router", "decode-0"), why_cannot_serve=lambda left: None, **policy):
    clock, procs = Clock(), FakeProcesses(names)
    supervisor = Supervisor(names, RestartPolicy(**policy), procs.poll_exit, procs.respawn,
                            why_cannot_serve=why_cannot_serve, log_path_of=lambda n: f"/logs/{n}.log", clock=clock)
    return supervisor, procs, clock


def crash_and_restart(supervisor, procs, clock, name="decode-0", code=-9) -> float:
    """Crash ``name`` now; advance the clock to its restart; returns the backoff it waited."""
    procs.exit_codes[name] = code
    events = supervisor.step()
    assert events[0].kind == "exited"
    crashed_at = clock.now
    while procs.exit_codes[name] is not None:
        clock.now += 0.25
        supervisor.step()
    return clock.now - crashed_at


def test_backoff_doubles_up_to_the_cap():
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.backoff_s(n) for n in range(1, 9)] == [0, 1, 2, 4, 8, 16, 30, 30]
    assert policy.backoff_s(10_000) == 30.0


def test_a_first_crash_is_restarted_at_once_and_the_next_after_the_backoff():
    supervisor, procs, clock = make(max_restarts=5)
    procs.exit_codes["decode-0"] = -signal.SIGKILL
    exited, restarted = supervisor.step()
    assert exited.kind == "exited" and exited.name == "decode-0"
    assert "killed by signal SIGKILL" in exited.message and "/logs/decode-0.log" in exited.message
    assert "restarting now (attempt 1 of 5)" in exited.message
    assert restarted.kind == "restarted" and "as pid 101" in restarted.message and procs.respawned == ["decode-0"]
    procs.exit_codes["decode-0"] = -signal.SIGKILL  # again, at once: a crash loop backs off
    [event] = supervisor.step()
    assert "restarting in 1 s (attempt 2 of 5)" in event.message
    clock.now += 0.9
    assert supervisor.step() == [] and procs.respawned == ["decode-0"]  # still backing off: no busy restart loop
    clock.now += 0.1
    [event] = supervisor.step()
    assert event.kind == "restarted" and "as pid 102" in event.message
    assert procs.respawned == ["decode-0"] * 2 and supervisor.step() == []


def test_consecutive_crashes_back_off_exponentially_then_give_up():
    supervisor, procs, clock = make(max_restarts=3)
    waits = [crash_and_restart(supervisor, procs, clock) for _ in range(3)]
    assert waits == [0.0, 1.0, 2.0]
    procs.exit_codes["decode-0"] = 1
    [event] = supervisor.step()
    assert event.kind == "given_up" and "exited with code 1" in event.message
    assert "not restarted: 4 crashes in a row (max_restarts=3)" in event.message
    clock.now += 3600
    assert supervisor.step() == [] and len(procs.respawned) == 3  # given up: stays down
    assert supervisor.given_up == {"decode-0"}


def test_the_count_starts_over_after_a_process_stayed_up():
    supervisor, procs, clock = make(max_restarts=2, stable_after_s=60.0)
    assert crash_and_restart(supervisor, procs, clock) == 0.0
    assert crash_and_restart(supervisor, procs, clock) == 1.0
    clock.now += 60.0  # up for a minute: recovered
    assert crash_and_restart(supervisor, procs, clock) == 0.0
    assert crash_and_restart(supervisor, procs, clock) == 1.0
    procs.exit_codes["decode-0"] = -9
    assert [e.kind for e in supervisor.step()] == ["given_up"]


def test_max_restarts_0_leaves_a_dead_process_down_and_the_cluster_serving():
    supervisor, procs, clock = make(names=("router", "decode-0", "decode-1"), max_restarts=0,
                                    why_cannot_serve=lambda left: None if "decode-1" in left else "no decoder")
    procs.exit_codes["decode-0"] = -9
    [event] = supervisor.step()
    assert event.kind == "given_up" and "restarts are off (max_restarts=0)" in event.message
    assert supervisor.failure is None
    procs.exit_codes["decode-1"] = -9
    events = supervisor.step()
    assert [e.kind for e in events] == ["given_up", "cluster_failed"]
    assert supervisor.failure == "no decoder" and "cannot serve: no decoder" in events[-1].message


def test_why_cannot_serve_sees_the_processes_not_given_up():
    seen = []
    supervisor, procs, _ = make(names=("router", "prefill-0", "decode-0"), max_restarts=0,
                                why_cannot_serve=lambda left: seen.append(set(left)))
    procs.exit_codes["prefill-0"] = 0
    supervisor.step()
    assert seen == [{"router", "decode-0"}] and supervisor.failure is None


def test_a_failed_start_counts_as_another_crash():
    supervisor, procs, clock = make(max_restarts=2)
    procs.exit_codes["decode-0"] = -9
    procs.fail_next_start = True
    exited, failed = supervisor.step()  # restarted at once: the start fails
    assert exited.kind == failed.kind == "exited" and "failed to start (no such file)" in failed.message
    assert "restarting in 1 s (attempt 2 of 2)" in failed.message
    clock.now += 1.0
    assert [e.kind for e in supervisor.step()] == ["restarted"]


def test_processes_are_independent():
    supervisor, procs, clock = make(names=("router", "decode-0"), max_restarts=1)
    procs.exit_codes["router"] = -15
    procs.exit_codes["decode-0"] = -9
    events = supervisor.step()
    assert sorted((e.name, e.kind) for e in events) == [("decode-0", "exited"), ("decode-0", "restarted"),
                                                         ("router", "exited"), ("router", "restarted")]
    procs.exit_codes["decode-0"] = -9  # a second crash in a row: decode-0 backs off, the router is untouched
    assert [(e.name, e.kind) for e in supervisor.step()] == [("decode-0", "given_up")]


@pytest.mark.parametrize("code, text", [(-9, "was killed by signal SIGKILL"), (-15, "was killed by signal SIGTERM"),
                                        (0, "exited with code 0"), (3, "exited with code 3")])
def test_describe_exit(code, text):
    assert describe_exit(code) == text


def test_bad_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


def test_a_planned_exit_is_replaced_at_once_and_counts_no_crash():
    supervisor, procs, clock = make(max_restarts=1)
    crash_and_restart(supervisor, procs, clock)  # one real crash: the next would be over the limit
    for _ in range(3):  # a rolling restart, again and again: never a backoff, never given up
        supervisor.expect_exit("decode-0")
        assert supervisor.step() == []  # still draining
        procs.exit_codes["decode-0"] = 0
        [event] = supervisor.step()
        assert event.kind == "replaced" and "rolling restart" in event.message
        assert procs.exit_codes["decode-0"] is None
    assert supervisor.given_up == set()
    procs.exit_codes["decode-0"] = -9  # an unplanned exit afterwards is a crash again
    [event] = supervisor.step()
    assert event.kind == "given_up"


def test_a_rolling_restart_s_replacement_is_no_restart_in_the_count():
    """As `tandem ray status` counts (docs/deploy-ray.md): a crash after a rolling restart is restart 1, not 2."""
    supervisor, procs, clock = make(max_restarts=3)
    supervisor.expect_exit("decode-0")
    procs.exit_codes["decode-0"] = 0
    assert [event.kind for event in supervisor.step()] == ["replaced"]
    procs.exit_codes["decode-0"] = -9
    events = supervisor.step()
    assert [event.kind for event in events] == ["exited", "restarted"], events
    assert events[1].message.endswith("(restart 1)")


def test_a_frozen_process_is_killed_and_its_exit_restarted_as_a_crash():
    clock, procs = Clock(), FakeProcesses(("router", "decode-0"))
    frozen: dict[str, str] = {}
    killed: list[str] = []
    supervisor = Supervisor(("router", "decode-0"), RestartPolicy(max_restarts=1), procs.poll_exit, procs.respawn,
                            clock=clock, why_frozen=frozen.get, kill=killed.append)
    assert supervisor.step() == [] and killed == []
    frozen["decode-0"] = "gave no sign of life for 31 s"
    [event] = supervisor.step()
    assert (event.kind, event.message) == ("frozen", "decode-0 gave no sign of life for 31 s; killing it")
    assert killed == ["decode-0"]
    assert supervisor.step() == [] and killed == ["decode-0"]  # one kill while it dies, not one a step
    procs.exit_codes["decode-0"] = -signal.SIGKILL
    del frozen["decode-0"]  # the new process has not beaten yet
    exited, restarted = supervisor.step()
    assert exited.message.startswith("decode-0 was killed: it gave no sign of life for 31 s; restarting now")
    assert restarted.kind == "restarted" and procs.respawned == ["decode-0"]
    frozen["decode-0"] = "gave no sign of life for 31 s"  # frozen again: a second crash in a row, over the limit
    supervisor.step()
    procs.exit_codes["decode-0"] = -signal.SIGKILL
    [event] = supervisor.step()
    assert event.kind == "given_up" and "was killed: it gave no sign of life" in event.message


def test_a_process_draining_on_purpose_is_not_called_frozen():
    clock, procs = Clock(), FakeProcesses(("decode-0",))
    killed: list[str] = []
    supervisor = Supervisor(("decode-0",), RestartPolicy(), procs.poll_exit, procs.respawn, clock=clock,
                            why_frozen=lambda _: "gave no sign of life for 31 s", kill=killed.append)
    supervisor.expect_exit("decode-0")
    assert supervisor.step() == [] and killed == []


def test_why_frozen_without_kill_is_refused():
    with pytest.raises(ValueError, match="why_frozen needs kill"):
        Supervisor(("a",), RestartPolicy(), lambda _: None, lambda _: None, why_frozen=lambda _: None)
