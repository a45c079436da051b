"""Test-only entry point: the ``tandem`` CLI with engine steps made slow, as on a big model or a loaded CPU.

``python -m tests.cluster.slow_steps <tandem args>`` runs ``deploy.cli`` (a per-role process, or a LocalCluster started
with ``entry_module="tests.cluster.slow_steps"``; ``tandem up``'s own workers are forked with ``deploy.cli`` and
are not slowed); in worker processes, every
engine step that ran a prompt chunk of at least ``TANDEM_TEST_SLOW_MIN_CHUNK`` tokens then burns
``TANDEM_TEST_SLOW_STEP_S`` more seconds of CPU in torch matmuls (which, like a real forward, release
the GIL between ops and keep the cores busy). With ``TANDEM_TEST_SLOW_ONCE=1`` only the first such
step is slow. ``TANDEM_TEST_STEP_DELAY_S`` adds a pause after every step (a slower model: long
streams stay in flight long enough for a test to act on them). The router process is left alone (it
must never import torch).
"""

from __future__ import annotations

import os
import sys
import time


def _burn(seconds: float) -> None:
    import torch

    a = torch.randn(256, 256)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


def _patch_engine() -> None:
    from pipeline.engine import LLMEngine

    slow_s = float(os.environ.get("TANDEM_TEST_SLOW_STEP_S", "0"))
    min_chunk = int(os.environ.get("TANDEM_TEST_SLOW_MIN_CHUNK", "64"))
    once = os.environ.get("TANDEM_TEST_SLOW_ONCE") == "1"
    delay_s = float(os.environ.get("TANDEM_TEST_STEP_DELAY_S", "0"))
    step = LLMEngine.step
    num_slowed = 0

    def slow_step(self):
        nonlocal num_slowed
        outputs = step(self)
        plan = self.last_plan
        if plan is not None and any(c.num_tokens >= min_chunk for c in plan.chunks) and not (once and num_slowed):
            num_slowed += 1
            _burn(slow_s)
        if delay_s and plan is not None and plan.chunks:
            time.sleep(delay_s)
        return outputs

    LLMEngine.step = slow_step


if __name__ == "__main__":
    if any(arg in ("worker", "prefill", "decode") for arg in sys.argv[1:]):
        _patch_engine()
    from deploy.cli import main

    sys.exit(main())
