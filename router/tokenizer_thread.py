"""The router's tokenizer work, off the HTTP event loop.

Rendering a chat template and tokenizing a long prompt take milliseconds to seconds of CPU; on the event loop
they would hold up every stream in flight and the health checks. ``run_tokenizer_work`` runs such a call on one
thread of its own: the loop goes on serving while it runs (a fast tokenizer releases the GIL while it encodes),
and one thread means the tokenizer, which is not safe to call from several threads at once, never is.
"""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")


async def run_tokenizer_work(work: Callable[[], T]) -> T:
    """``work()`` on the tokenizer thread (with the caller's context: its trace span), awaited; its exception raised."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_executor, context.run, work)
