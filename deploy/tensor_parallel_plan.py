"""How many tensor-parallel ranks each worker of a local cluster runs: ``tandem up``'s
``--tensor-parallel-size`` (every role) and ``--prefill-tensor-parallel-size`` / ``--decode-tensor-parallel-size``
(PrefillOnly / DecodeOnly workers), checked before anything starts. Pure functions, no torch.

Colocated (PrefillAndDecode) workers take ``--tensor-parallel-size``; PrefillOnly and DecodeOnly workers their own
flag or it. Whatever a role cannot run with several ranks is refused by ``pipeline.config.tensor_parallel_role_error``
(the KV of a prefill or decode worker's ranks moves re-sliced, on CPU).
"""

from __future__ import annotations

from deploy.local_launcher import worker_names
from pipeline.config import PipelineRole, tensor_parallel_role_error

_ROLE_FLAGS = {"prefill": (PipelineRole.PrefillOnly, "--prefill-tensor-parallel-size"),
               "decode": (PipelineRole.DecodeOnly, "--decode-tensor-parallel-size"),
               "colocated": (PipelineRole.PrefillAndDecode, "--tensor-parallel-size")}


def worker_tensor_parallel_sizes(num_prefill: int, num_decode: int, num_colocated: int, tensor_parallel_size: int,
                                 prefill_size: int | None = None, decode_size: int | None = None, *,
                                 device: str = "cpu", transport: str = "auto") -> dict[str, int]:
    """{worker name: its tensor_parallel_size} for every worker (``prefill_size`` / ``decode_size`` None: the
    shared ``tensor_parallel_size``). ``ValueError`` naming the flag for a size below 1, or for several ranks
    on a role that cannot run them on ``device`` with KV ``transport`` (only when that role has workers)."""
    sizes = {"prefill": tensor_parallel_size if prefill_size is None else prefill_size,
             "decode": tensor_parallel_size if decode_size is None else decode_size,
             "colocated": tensor_parallel_size}
    given = {"prefill": prefill_size is not None, "decode": decode_size is not None, "colocated": True}
    counts = {"prefill": num_prefill, "decode": num_decode, "colocated": num_colocated}
    for kind, size in sizes.items():
        role, flag = _ROLE_FLAGS[kind]
        flag = flag if given[kind] else "--tensor-parallel-size"  # the flag the size came from
        if size < 1:
            raise ValueError(f"{flag}: must be >= 1 (got {size})")
        error = tensor_parallel_role_error(role, size, device, transport)
        if counts[kind] and error is not None:
            raise ValueError(f"{flag} {size} with {counts[kind]} {kind} worker{'s' if counts[kind] > 1 else ''}: "
                             + error.removeprefix("tensor_parallel_size: "))
    return {name: sizes[name.split("-")[0]] for name in worker_names(num_prefill, num_decode, num_colocated)}
