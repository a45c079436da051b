"""First contact between P and D: both ends check the other's compatibility record and agree on a transport.

The receiver decides (``negotiate``) and replies; the sender checks the reply again (``check_reply``),
so a mismatch is refused with the same clear message on both sides, never discovered as garbage later.
"""

from __future__ import annotations

from pipeline.protocol.transfer import Hello, HelloReply, KVLayout


def negotiate(receiver: KVLayout, hello: Hello, receiver_host_id: str) -> tuple[str, str]:
    """``(transport, "")`` on success, ``("", error)`` naming every differing field otherwise.

    The transport is the sender's most preferred one that the receiver accepts; "shm" only counts when
    both ends see the same /dev/shm.
    """
    problems = receiver.mismatch(hello.layout, ours="receiver", theirs="sender")
    if problems:
        return "", "incompatible KV layout: " + "; ".join(problems)
    same_host = hello.host_id == receiver_host_id
    for transport in hello.layout.transports:
        if transport in receiver.transports and (transport != "shm" or same_host):
            return transport, ""
    return "", (f"no common transport: receiver accepts {list(receiver.transports)}, sender "
                f"{list(hello.layout.transports)}, same host: {same_host}")


def check_reply(sender: KVLayout, endpoint: str, reply: HelloReply) -> str:
    """The sender's own verdict on a ``HelloReply``: "" to go ahead, else why not."""
    if not reply.ok:
        return f"handshake refused by {endpoint}: {reply.error}"
    if reply.layout is None:
        return f"incompatible receiver {endpoint}: its reply has no layout"
    problems = sender.mismatch(reply.layout, ours="sender", theirs="receiver")
    if problems:
        return f"incompatible receiver {endpoint}: incompatible KV layout: " + "; ".join(problems)
    if reply.transport not in sender.transports:
        return f"incompatible receiver {endpoint}: transport {reply.transport!r} is not one of {sender.transports}"
    return ""
