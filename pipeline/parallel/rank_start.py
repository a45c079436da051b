"""How a tensor-parallel group's child ranks come to be (``start_rank``, for ``ranks.RankGroup``).

1. **Preforked** (``prefork_ranks``): a cluster worker forks its ranks 1..N-1 first thing, before its CPU
   placement, in the state the launcher's zygote forks workers in: one thread, torch imported (by the zygote) but
   never run, not even ``set_num_threads``; ``tandem generate`` likewise, once it has imported ``RANK_PRELOAD``
   itself (``prefork_warm_ranks``). (A fork after torch ran a parallel region hangs the child's first one:
   GNU OpenMP's pool does not survive a fork; measured.) Each child waits for its ``RankArgs`` on its pipe; the
   engine's group hands them over once it knows them (the store's port, the checkpoint, each rank's cores and
   threads). A TP 2 worker of the tiny model then serves 0.14 s after its placement instead of 3.6 s (2-core Zen
   4): the children import nothing.
2. Otherwise **from this process's multiprocessing fork server** (``rank_context``), started with the first
   group and preloaded (``RANK_PRELOAD``): the first group pays one interpreter's imports (about 3 s), every later
   one starts its ranks in a fraction of a second (an offline process building engines in turn). The server is a
   clean single-threaded process, never one with torch's threads running, and never touches CUDA.

Either way a child runs ``ranks.run_rank`` and dies with rank 0 (``ranks._die_with``).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import threading

logger = logging.getLogger(__name__)

RANK_PRELOAD = ["torch", "torch.distributed", "safetensors.torch", "transformers.utils.type_validators",
                "transformers.models.auto.configuration_auto"]
_preforked: list[tuple] = []  # (process, rank 0's end of its pipe), in rank order, waiting for their RankArgs


def rank_context():
    """The multiprocessing context child ranks start from when none was preforked: this process's fork server,
    preloaded (``RANK_PRELOAD``; the list is read when the server starts, with the first group)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    return context


def prefork_ranks(num_ranks: int) -> int:
    """Fork ``num_ranks`` children now, to become ranks 1..N-1 of this process's first group; how many were
    forked (none when another thread runs here already: a fork of a threaded process is not safe). Call it
    before this process runs anything in torch (see the module docstring)."""
    if threading.active_count() != 1:
        logger.info("ranks not preforked: %d threads run here; they will start from the fork server",
                    threading.active_count())
        return 0
    context = multiprocessing.get_context("fork")
    for _ in range(num_ranks):
        ours, theirs = context.Pipe()
        inherited = [pipe for _, pipe in _preforked] + [ours]  # rank 0's ends: the child closes its copies
        process = context.Process(target=_await_rank_args, args=(theirs, inherited),
                                  name=f"tandem-tp-rank{len(_preforked) + 1}", daemon=True)
        process.start()
        theirs.close()
        _preforked.append((process, ours))
    logger.info("%d rank process(es) forked, waiting for their group", num_ranks)
    return num_ranks


def prefork_warm_ranks(num_ranks: int) -> int:
    """``prefork_ranks`` in a process that has not imported what a rank needs (``tandem generate``): import
    ``RANK_PRELOAD`` here first (rank 0 imports it anyway), so that the children start with it loaded."""
    for name in RANK_PRELOAD:
        importlib.import_module(name)
    return prefork_ranks(num_ranks)


def start_rank(args, name: str) -> tuple:
    """(process, rank 0's end of its pipe) of a child running ``ranks.run_rank(args)``: a preforked child if one
    is waiting, else one from the fork server."""
    while _preforked:
        process, pipe = _preforked.pop(0)
        try:
            pipe.send(args)
            return process, pipe
        except OSError:  # it died waiting (killed with its process group, say): the next, or the fork server
            pipe.close()
    from pipeline.parallel.ranks import run_rank

    logger.info("%s starts from the fork server", name)
    context = rank_context()
    ours, theirs = context.Pipe()
    process = context.Process(target=run_rank, args=(args, theirs), name=name, daemon=True)
    process.start()
    theirs.close()
    return process, ours


def _await_rank_args(pipe, inherited) -> None:
    """A preforked child: wait for its ``RankArgs``, then be that rank (or leave when rank 0 goes first)."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when ranks stop (as ``run_rank`` says)
        signal.signal(sig, signal.SIG_IGN)
    for conn in inherited:  # else rank 0's exit would not close the pipe: no end-of-file here
        conn.close()
    try:
        args = pipe.recv()
    except (EOFError, OSError):  # rank 0 went (or never needed this rank)
        os._exit(0)
    from pipeline.parallel.ranks import run_rank

    run_rank(args, pipe)
