"""What tracing hands out when it is off: shared objects whose every method does nothing."""

from __future__ import annotations


class NoopSpan:
    """Stands in for an OpenTelemetry span: ``set_attribute``, ``set_attributes``, ``add_event``, ``end``."""

    __slots__ = ()
    is_recording = False

    def set_attribute(self, key, value) -> None:
        pass

    def set_attributes(self, attributes) -> None:
        pass

    def add_event(self, name, attributes=None) -> None:
        pass

    def end(self, end_time=None) -> None:
        pass


class NoopRequestSpans:
    """Stands in for ``RequestSpans`` (same methods, nothing kept)."""

    __slots__ = ()

    def start(self, request_id, name, parent=None, attributes=None, start_ns=None) -> None:
        pass

    def set(self, request_id, name, attributes) -> None:
        pass

    def switch(self, request_id, ended, started, parent=None, at_ns=None) -> None:
        pass

    def count(self, request_id, name, key, amount=1) -> None:
        pass

    def end(self, request_id, name, attributes=None, end_ns=None) -> None:
        pass

    def record(self, request_id, name, parent, start_ns, end_ns, attributes=None) -> None:
        pass

    def transfer(self, request_id, name, parent, result, ends=None, num_blocks=None) -> None:
        pass

    def end_all(self, request_id, attributes=None) -> None:
        pass

    def retain(self, request_ids) -> None:
        pass

    def __len__(self) -> int:
        return 0


NOOP_SPAN = NoopSpan()
NOOP_REQUEST_SPANS = NoopRequestSpans()
