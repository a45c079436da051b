"""``RequestTable``: the requests an engine knows — each sequence by id, each request's choices, and the
finished prefill-only requests whose blocks wait to be shipped — and how one ends (finish, abort, release).

Sequence ids: the request id for choice 0, "<request id>/<i>" for choice i > 0 (``pipeline/choices.py``).
Ending a request frees it everywhere at once (scheduler, persistent batch, output processor, KV blocks);
scheduling, running and emitting stay with the engine.
"""

from __future__ import annotations

from pipeline.choices import RequestChoices
from pipeline.protocol import FinishReason
from pipeline.sequence import Sequence, SequenceStatus


class RequestTable:
    def __init__(self, scheduler, runner, kv_manager, output_processor) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv_manager = kv_manager
        self.output_processor = output_processor
        self._sequences: dict[str, Sequence] = {}  # by sequence id, while it runs (queued, reserved, running, paused)
        self._choices = RequestChoices()  # n > 1: each request's choices, forked from choice 0
        self._held: dict[str, Sequence] = {}  # finished prefill-only requests whose blocks are not shipped yet

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    def __getitem__(self, seq_id: str) -> Sequence:
        return self._sequences[seq_id]

    def get(self, seq_id: str) -> Sequence | None:
        return self._sequences.get(seq_id)

    def add(self, request_id: str, members: list[Sequence]) -> None:
        """Record a queued request's choices (choice 0 first)."""
        for member in members:
            self._sequences[member.request_id] = member
            self.output_processor.add(member)
        self._choices.add(request_id, members)

    def members(self, request_id: str) -> list[Sequence]:
        """Every choice of a request (n > 1: index order), finished or not, while the request is known."""
        return self._choices.members(request_id)

    def fork_waiting_choices(self, seq: Sequence) -> None:
        """``seq`` emitted a token: if it is choice 0, its prompt KV is written (or arrived), so the others start."""
        for sibling in self._choices.take_unforked(seq):
            self.scheduler.fork(seq, sibling)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None,
               ended_by_stop_token: bool = False) -> bool:
        """``seq`` stopped: free it (a prefill-only request keeps its blocks until ``release_blocks``); True
        when it was the last of its request's choices to end. ``ended_by_stop_token``: its last token is an
        EOS or one of ``stop_token_ids`` (whose text the answer leaves out)."""
        seq.drop_placeholders()  # overlap: the step launched after this token sampled one too many
        self.runner.forget(seq.request_id)
        self.scheduler.finish(seq, reason, stop_reason, keep_blocks=seq.is_prefill_only)
        if seq.is_prefill_only:
            self._held[seq.request_id] = seq
        self.output_processor.finalize_text(seq, ended_by_stop_token)
        del self._sequences[seq.request_id]
        return self._choices.leave(seq)

    def release_blocks(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request (or one aborted with ``keep_blocks``) kept for shipping."""
        if self._held.pop(request_id, None) is not None:
            self.kv_manager.free(request_id)

    def abort_request(self, request_id: str, keep_blocks: bool = False) -> bool:
        """End a request (every choice of it) wherever it is (queued, reserved, running or held) and free
        its blocks (``keep_blocks``: hold them until ``release_blocks``)."""
        members, unforked = self._choices.pop(request_id)
        for member in unforked:  # never scheduled: nothing to free
            self._forget_unforked(member)
        found = self._abort_one(request_id, keep_blocks)
        for member in members[1:]:
            found = self._abort_one(member.request_id, False) or found
        return found

    def abort_choice(self, request_id: str, index: int) -> bool:
        """End one choice of an n > 1 request; the others go on. A stop string matches only after a token,
        so choice 0 has started the others by then."""
        members = self._choices.members(request_id)
        if not 0 <= index < len(members):
            return False
        if len(members) == 1:
            return self.abort_request(request_id)
        member = members[index]
        if self._choices.is_unforked(member):
            self._choices.drop_unforked(member)
            self._forget_unforked(member)
        elif not self._abort_one(member.request_id, False):
            return False
        self._choices.leave(member)
        return True

    def _forget_unforked(self, member: Sequence) -> None:
        self._sequences.pop(member.request_id, None)
        self.output_processor.drop(member.request_id)
        member.status = SequenceStatus.FINISHED

    def _abort_one(self, request_id: str, keep_blocks: bool) -> bool:
        if request_id in self._held:
            if not keep_blocks:
                self.release_blocks(request_id)
            return True
        seq = self._sequences.pop(request_id, None)
        if seq is None:
            return False
        self.runner.forget(request_id)
        self.scheduler.finish(seq, FinishReason.ABORT.value, keep_blocks=keep_blocks)
        if keep_blocks:
            self._held[request_id] = seq
        self.output_processor.drop(request_id)
        return True
