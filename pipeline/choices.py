"""The choices of each request an engine runs (n > 1, best_of candidates), kept together.

Choice 0 carries the request's id and runs first; the others (ids "<request id>/<i>") wait, unforked,
until choice 0's prompt KV is written, then start from its blocks (``Scheduler.fork``). A request ends
when its last choice does. Pure bookkeeping: the engine schedules, frees and emits.
"""

from __future__ import annotations

from pipeline.sequence import Sequence


class RequestChoices:
    def __init__(self) -> None:
        self._members: dict[str, list[Sequence]] = {}  # request id -> its choices, index order
        self._unforked: dict[str, list[Sequence]] = {}  # request id -> choices waiting for choice 0's prompt

    def add(self, request_id: str, members: list[Sequence]) -> None:
        self._members[request_id] = members
        if len(members) > 1:
            self._unforked[request_id] = list(members[1:])

    def members(self, request_id: str) -> list[Sequence]:
        """Every choice of a request, finished or not, while any runs (index order)."""
        return list(self._members.get(request_id, []))

    def take_unforked(self, first: Sequence) -> list[Sequence]:
        """The choices to start now that ``first`` (choice 0) emitted its first token; each only once."""
        return self._unforked.pop(first.request_id, []) if first.index == 0 else []

    def is_unforked(self, member: Sequence) -> bool:
        return member in self._unforked.get(member.family_id, ())

    def drop_unforked(self, member: Sequence) -> None:
        """A choice ends before it started (the router stopped it)."""
        self._unforked[member.family_id].remove(member)

    def pop(self, request_id: str) -> tuple[list[Sequence], list[Sequence]]:
        """Forget a request: (its choices, those of them never started)."""
        return self._members.pop(request_id, []), self._unforked.pop(request_id, [])

    def leave(self, seq: Sequence) -> bool:
        """``seq`` ended: True when it was the last of its request's choices to end."""
        members = self._members.get(seq.family_id)
        if members is None:
            return True
        if all(m is seq or m.is_finished for m in members):
            del self._members[seq.family_id]
            return True
        return False
