"""Stop-string matching over incrementally detokenized text (torch-free; shared by engine and router)."""

from __future__ import annotations


class StopStringMatcher:
    """Finds the first stop string in a growing text.

    Only the tail that could contain a new match is searched each time (the new characters plus
    the longest stop string's length minus one), so checking is O(new text) per step.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, num_new_chars: int) -> tuple[str, str] | None:
        """Return ``(text truncated at the stop, the stop string)`` for the earliest match, or None."""
        if not self.stop or num_new_chars <= 0:
            return None
        start = max(0, len(text) - num_new_chars - self._max_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        return text[:end], stop
