"""First contact between P and D: both ends check the other's compatibility record and agree on a transport.

The receiver decides (``negotiate``) and replies; the sender checks the reply again (``check_reply``),
so a mismatch is refused with the same clear message on both sides, never discovered as garbage later.
"""

from __future__ import annotations

from pipeline.protocol.transfer import IN_PLACE_TRANSPORTS, Hello, HelloReply, KVLayout


def negotiate(receiver: KVLayout, hello: Hello, receiver_host_id: str) -> tuple[str, str]:
    """``(transport, "")`` on success, ``("", error)`` naming every differing field otherwise.

    The transport is the sender's most preferred one that the receiver accepts; an in-place one ("cuda_ipc",
    "shm") only counts when both ends are on the same host (they see the same /dev/shm).
    """
    problems = receiver.mismatch(hello.layout, ours="receiver", theirs="sender")
    if problems:
        return "", "incompatible KV layout: " + "; ".join(problems)
    same_host = hello.host_id == receiver_host_id
    for transport in hello.layout.transports:
        if transport in receiver.transports and (transport not in IN_PLACE_TRANSPORTS or same_host):
            return transport, ""
    return "", (f"no common transport: receiver accepts {list(receiver.transports)}, sender "
                f"{list(hello.layout.transports)}, same host: {same_host}")


def check_reply(sender: KVLayout, endpoint: str, reply: HelloReply, offered: tuple[str, ...]) -> str:
    """The sender's own verdict on a ``HelloReply`` to a ``Hello`` that ``offered`` these transports (the sender's
    own list, less those a handshake again left out): "" to go ahead, else why not."""
    if not reply.ok:
        return f"handshake refused by {endpoint}: {reply.error}"
    if reply.layout is None:
        return f"incompatible receiver {endpoint}: its reply has no layout"
    problems = sender.mismatch(reply.layout, ours="sender", theirs="receiver")
    if problems:
        return f"incompatible receiver {endpoint}: incompatible KV layout: " + "; ".join(problems)
    if reply.transport not in offered:
        return f"incompatible receiver {endpoint}: transport {reply.transport!r} is not one of {offered}"
    return ""
