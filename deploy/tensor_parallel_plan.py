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
        if given[kind] and kind != "colocated" and not counts[kind]:  # a flag that would change nothing
            raise ValueError(f"{flag} {size}: there is no {kind} worker to run it (--{kind} 0)")
        error = tensor_parallel_role_error(role, size, device, transport)
        if counts[kind] and error is not None:
            raise ValueError(f"{flag} {size} with {counts[kind]} {kind} worker{'s' if counts[kind] > 1 else ''}: "
                             + error.removeprefix("tensor_parallel_size: "))
    return {name: sizes[name.split("-")[0]] for name in worker_names(num_prefill, num_decode, num_colocated)}


def check_tensor_parallel_workers(config, sizes: dict[str, int]) -> None:
    """What the workers of several ranks cannot run with this checkpoint and config (a size that does not split
    its heads, MLP or quantization blocks; speculative decoding on a role that cannot): one ``ValueError`` naming
    the role and size before anything starts. Reads the checkpoint's config with transformers, only when some
    worker has several ranks."""
    wanted = sorted({(_ROLE_FLAGS[name.split("-")[0]][0], size) for name, size in sizes.items() if size > 1},
                    key=lambda pair: (pair[0].value, pair[1]))
    if not wanted:
        return
    from pipeline.builtin_model import builtin_model_path
    from pipeline.parallel import UnsupportedTensorParallel, check_tensor_parallel_setup

    model_path = config.model.model_path or str(builtin_model_path())
    for role, size in wanted:
        try:
            check_tensor_parallel_setup(config, role, size, model_path)
        except UnsupportedTensorParallel as exc:
            raise ValueError(f"{role.value} workers of {size} ranks: {exc}") from None
