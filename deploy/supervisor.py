"""The restart policy of a cluster's processes: restart with exponential backoff, give up on a process
that keeps crashing, and say when what is left can no longer serve.

``Supervisor`` never touches a process itself: its owner passes ``poll_exit`` (a process's exit code,
None while it runs) and ``respawn`` (start it again). ``LocalCluster`` passes subprocess callbacks; a
Ray launcher can run the same policy over its actors. ``step()`` is one pass that returns what
happened, so the policy is tested with an injected clock and no processes at all.

Per process:

1. It exits (any code, any signal): that is a crash. If it had been up for ``stable_after_s`` it had
   recovered, so the count of consecutive crashes starts over; then the count goes up by one.
2. Count <= ``max_restarts``: restart it — at once after a first crash (a process that had been up
   is back in about a second: a worker is forked warm, ``deploy.zygote``), then after
   ``initial_backoff_s * 2**(count-2)`` for each further crash in a row, capped at ``max_backoff_s``
   (a crash loop backs off). Otherwise it is given up: it stays down.
3. After each give-up, ``why_cannot_serve(names not given up)`` decides whether the cluster is still
   useful; a reason (not None) is the supervisor's ``failure`` and its owner should stop.
4. A process that runs but is frozen (``why_frozen(name)`` gives a reason: ``deploy.watchdog``) is killed
   (``kill(name)``); its exit is then a crash like any other, told as "was killed: it gave no sign of life ...".
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """How hard to try; ``max_restarts=0`` means a process that exits stays down."""

    max_restarts: int = 5  # consecutive crashes that are restarted; one more and the process is given up
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # up this long before exiting: the crash count starts over

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0 (got {self.max_restarts})")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(f"backoff: need 0 <= initial_backoff_s <= max_backoff_s "
                             f"(got {self.initial_backoff_s}, {self.max_backoff_s})")

    def backoff_s(self, num_consecutive_crashes: int) -> float:
        """Delay before the restart that follows the ``num_consecutive_crashes``-th crash in a row (>= 1):
        none after the first, then ``initial_backoff_s`` doubling up to ``max_backoff_s``."""
        if num_consecutive_crashes <= 1:
            return 0.0
        exponent = min(num_consecutive_crashes - 2, 62)  # 2**62 s is past any cap; avoids huge ints
        return min(self.initial_backoff_s * 2 ** exponent, self.max_backoff_s)


@dataclass(frozen=True)
class SupervisorEvent:
    """Something the supervisor did: ``kind`` is "exited", "restarted", "replaced", "frozen" (killed: its exit
    follows), "given_up" or "cluster_failed"."""

    kind: str
    name: str
    message: str


@dataclass
class _ProcessState:
    started_at: float
    num_consecutive_crashes: int = 0
    num_restarts: int = 0  # since the supervisor started, for messages
    restart_at: float | None = None  # a restart is pending at this time
    is_given_up: bool = False
    is_being_replaced: bool = False  # a planned stop (rolling restart): its exit is no crash, restart at once
    frozen_reason: str | None = None  # killed as frozen (why): its exit is told with this


def describe_exit(returncode: int) -> str:
    """'was killed by signal SIGKILL' / 'exited with code 1', as a user reads it."""
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """Applies a ``RestartPolicy`` to named processes; call ``step()`` periodically from one thread."""

    def __init__(
        self,
        names: Iterable[str],
        policy: RestartPolicy,
        poll_exit: Callable[[str], int | None],
        respawn: Callable[[str], int | None],
        why_cannot_serve: Callable[[set[str]], str | None] = lambda _: None,
        log_path_of: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        why_frozen: Callable[[str], str | None] | None = None,
        kill: Callable[[str], None] | None = None,
    ) -> None:
        """``respawn(name)`` starts the process again and may return its pid (for the message); it may
        raise, which counts as another crash. ``why_cannot_serve`` gets the names not given up.
        ``why_frozen(name)`` (asked only of a running process) and ``kill(name)`` go together."""
        if why_frozen is not None and kill is None:
            raise ValueError("why_frozen needs kill")
        self.policy = policy
        self._poll_exit = poll_exit
        self._respawn = respawn
        self._why_cannot_serve = why_cannot_serve
        self._log_path_of = log_path_of
        self._clock = clock
        self._why_frozen = why_frozen
        self._kill = kill
        now = clock()
        self._states = {name: _ProcessState(started_at=now) for name in names}
        self.failure: str | None = None  # why the cluster cannot serve any more; set once

    def expect_exit(self, name: str) -> None:
        """``name`` is being stopped on purpose (a rolling restart): restart it as soon as it exits, without
        counting a crash or waiting a backoff."""
        self._states[name].is_being_replaced = True

    @property
    def given_up(self) -> set[str]:
        return {name for name, state in self._states.items() if state.is_given_up}

    def step(self) -> list[SupervisorEvent]:
        """Notice exits, restart what is due, give up on what crashed too often. Never blocks."""
        events: list[SupervisorEvent] = []
        now = self._clock()
        for name, state in self._states.items():
            if state.is_given_up:
                continue
            if state.restart_at is None:
                returncode = self._poll_exit(name)
                if returncode is not None and state.is_being_replaced:
                    state.is_being_replaced = False
                    events.append(self._restart(name, state, now, planned=True))
                elif returncode is not None:
                    how = f"was killed: it {state.frozen_reason}" if state.frozen_reason else describe_exit(returncode)
                    state.frozen_reason = None
                    events.append(self._on_crash(name, state, how, now))
                elif state.frozen_reason is None and not state.is_being_replaced:
                    events.extend(self._kill_if_frozen(name, state))
            if state.restart_at is not None and now >= state.restart_at:  # due (at once after a first crash)
                events.append(self._restart(name, state, now))
        if self.failure is None and any(e.kind == "given_up" for e in events):
            reason = self._why_cannot_serve(set(self._states) - self.given_up)
            if reason is not None:
                self.failure = reason
                events.append(SupervisorEvent("cluster_failed", "", f"the cluster cannot serve: {reason}"))
        for event in events:
            logger.debug("%s", event.message)
        return events

    def _kill_if_frozen(self, name: str, state: _ProcessState) -> list[SupervisorEvent]:
        reason = self._why_frozen(name) if self._why_frozen is not None else None
        if reason is None:
            return []
        state.frozen_reason = reason
        self._kill(name)
        return [SupervisorEvent("frozen", name, f"{name} {reason}; killing it")]

    def _on_crash(self, name: str, state: _ProcessState, how: str, now: float) -> SupervisorEvent:
        if now - state.started_at >= self.policy.stable_after_s:
            state.num_consecutive_crashes = 0  # it had recovered: this is a new crash, not a loop
        state.num_consecutive_crashes += 1
        where = f"; log: {self._log_path_of(name)}" if self._log_path_of else ""
        limit = self.policy.max_restarts
        if state.num_consecutive_crashes > limit:
            state.is_given_up = True
            why = ("restarts are off (max_restarts=0)" if limit == 0 else
                   f"{state.num_consecutive_crashes} crashes in a row (max_restarts={limit})")
            return SupervisorEvent("given_up", name, f"{name} {how}; not restarted: {why}{where}")
        delay = self.policy.backoff_s(state.num_consecutive_crashes)
        state.restart_at = now + delay
        when = "restarting now" if delay == 0 else f"restarting in {delay:g} s"
        return SupervisorEvent(
            "exited", name, f"{name} {how}; {when} (attempt {state.num_consecutive_crashes} of {limit}){where}")

    def _restart(self, name: str, state: _ProcessState, now: float, planned: bool = False) -> SupervisorEvent:
        state.restart_at = None
        state.started_at = now
        try:
            pid = self._respawn(name)
        except Exception as exc:  # noqa: BLE001 - a failed start is one more crash, not a dead supervisor
            return self._on_crash(name, state, f"failed to start ({exc})", now)
        pid_text = f" as pid {pid}" if pid is not None else ""
        if planned:  # a rolling restart's replacement is no restart (as `tandem ray status` counts)
            return SupervisorEvent("replaced", name,
                                   f"{name} drained; its replacement started{pid_text} (rolling restart)")
        state.num_restarts += 1
        return SupervisorEvent("restarted", name, f"{name} restarted{pid_text} (restart {state.num_restarts})")
