"""CPU core lists in Linux list syntax ("0-3,6", as ``taskset -c`` and vLLM's CPU backend take them):
parsing and formatting only, so the config can check a list without importing the placement code."""

from __future__ import annotations

import re

_MAX_CORE = 65535  # far above any Linux NR_CPUS; bounds the list "0-99999999" would expand to
_ITEM = re.compile(r"(\d+)(?:-(\d+))?")


def parse_core_list(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (sorted, unique); ValueError saying what is wrong with ``text``."""
    if not text.strip():
        raise ValueError("empty core list (Linux list syntax: '0-3,6'; unset = every core)")
    cores: set[int] = set()
    for raw_item in text.split(","):
        item = raw_item.strip()
        if not item:
            raise ValueError("empty item in the core list (Linux list syntax: '0-3,6')")
        if re.fullmatch(r"-\d+(-\d+)?", item):
            raise ValueError(f"{item!r}: core numbers are >= 0")
        match = _ITEM.fullmatch(item)
        if match is None:
            raise ValueError(f"{item!r} is not a core number or range (Linux list syntax: '0-3,6')")
        first = int(match.group(1))
        last = first if match.group(2) is None else int(match.group(2))
        if last < first:
            raise ValueError(f"descending range {item!r}; write '{last}-{first}'")
        if last > _MAX_CORE:
            raise ValueError(f"core {last} is out of range (at most {_MAX_CORE})")
        cores.update(range(first, last + 1))
    return sorted(cores)


def format_core_list(cores: list[int] | set[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3,6": consecutive cores as ranges."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
