"""uvicorn's server, whose drain (SIGTERM, Ctrl-C) ends with every request answered.

uvicorn lets the requests in flight run for ``timeout_graceful_shutdown`` and then cancels their tasks, which ends
a response wherever it was: a plain-text 500 instead of an OpenAI error body, a stream cut without an error event.
Here, at ``drain_timeout_s`` the dispatcher fails what is still waiting or running (a 503 body; a stream's error
event), and uvicorn's own deadline comes a little later, for those answers to reach their clients."""

from __future__ import annotations

import asyncio

import uvicorn

DRAIN_GRACE_S = 5.0  # from the drain deadline to uvicorn's: for the failed requests' answers to go out


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout_s: float, dispatcher) -> None:
        config.timeout_graceful_shutdown = drain_timeout_s + DRAIN_GRACE_S
        super().__init__(config)
        self.drain_timeout_s, self.dispatcher = drain_timeout_s, dispatcher

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.get_running_loop().call_later(
            self.drain_timeout_s, self.dispatcher.fail_everything,
            f"the router is shutting down: the request did not finish within drain_timeout_s "
            f"({self.drain_timeout_s:g} s)")
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
