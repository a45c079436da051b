"""The watchdog's two halves without a cluster: a process's sign of life (``pipeline.sign_of_life``) and the
launcher's reading of it (``deploy.watchdog``), on real files and a real stopped process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from deploy.watchdog import Watchdog
from pipeline.sign_of_life import WATCHDOG_DIR_ENV, SignOfLife


def age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_process_is_unarmed_until_it_beats_then_frozen_once_silent_past_the_timeout(tmp_path):
    watchdog = Watchdog(tmp_path / "alive", timeout_s=30)
    sign = SignOfLife(str(watchdog.directory))
    assert watchdog.why_frozen(os.getpid()) is None  # still starting: never frozen
    sign.beat(now=100.0)
    assert watchdog.why_frozen(os.getpid()) is None
    age(sign.path, 29)
    assert watchdog.why_frozen(os.getpid()) is None
    age(sign.path, 45)
    reason = watchdog.why_frozen(os.getpid())
    assert reason == "gave no sign of life for 45 s (watchdog_timeout_s=30)"
    sign.beat(now=100.5)  # within the beat interval: no write
    assert watchdog.why_frozen(os.getpid()) is not None
    sign.beat(now=101.0)
    assert watchdog.why_frozen(os.getpid()) is None
    watchdog.forget(os.getpid())
    assert not sign.path.exists() and watchdog.why_frozen(os.getpid()) is None


def test_a_stopped_process_is_named_as_stopped(tmp_path):
    watchdog = Watchdog(tmp_path / "alive", timeout_s=1)
    child = subprocess.Popen([sys.executable, "-c", "import time\nfrom pipeline.sign_of_life import SignOfLife\n"
                              "s = SignOfLife()\nwhile True:\n    s.beat(); time.sleep(0.1)"],
                             env={**os.environ, **watchdog.env()})
    try:
        path = watchdog.directory / str(child.pid)
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline and child.poll() is None, "the child never beat"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(1.2)  # the stop takes effect; a running child would beat again in this time
        age(path, 5)
        assert watchdog.why_frozen(child.pid) == ("gave no sign of life for 5 s (it is stopped: SIGSTOP or a "
                                                  "debugger) (watchdog_timeout_s=1)")
    finally:
        child.kill()
        child.wait()


def test_off_means_no_environment_and_nothing_frozen(tmp_path):
    watchdog = Watchdog(tmp_path / "alive", timeout_s=0)
    assert watchdog.env() == {} and not watchdog.directory.exists()
    assert WATCHDOG_DIR_ENV not in watchdog.env()
    assert watchdog.why_frozen(os.getpid()) is None


def test_no_directory_means_no_beats(monkeypatch):
    monkeypatch.delenv(WATCHDOG_DIR_ENV, raising=False)
    sign = SignOfLife()
    assert sign.path is None
    sign.beat()  # nothing to do, nothing raised


def test_after_the_launcher_itself_stood_still_silence_counts_again_from_then(tmp_path, monkeypatch):
    """A host suspended (or the launcher stopped) for longer than the timeout: every process stood still too, and
    must not all be killed at once when the launcher looks again."""
    watchdog = Watchdog(tmp_path / "alive", timeout_s=30)
    sign = SignOfLife(str(watchdog.directory))
    sign.beat(now=1.0)
    now = [time.time()]
    monkeypatch.setattr(time, "time", lambda: now[0])
    assert watchdog.why_frozen(os.getpid()) is None
    now[0] += 0.2
    assert watchdog.why_frozen(os.getpid()) is None
    now[0] += 3600  # an hour suspended
    assert watchdog.why_frozen(os.getpid()) is None
    for _ in range(149):  # then 29.8 s of the launcher looking, the process silent
        now[0] += 0.2
        assert watchdog.why_frozen(os.getpid()) is None
    now[0] += 0.6
    assert watchdog.why_frozen(os.getpid()) == "gave no sign of life for 30 s (watchdog_timeout_s=30)"
