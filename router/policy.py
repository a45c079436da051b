"""Which workers serve a request: a pure function of the workers' load reports.

Rules, in order:

1. Candidates are live workers whose ``max_length`` fits the request and that are not draining,
   minus any excluded ones (a retry excludes the workers that just failed it).
2. Decode candidates are PrefillAndDecode and DecodeOnly workers (a DecodeOnly worker can prefill
   locally: the fallback when no PrefillOnly worker is alive).
3. The decode worker is the least loaded candidate: workers with free KV blocks first, then the
   fewest requests (the router's own in-flight count, which is fresher than the last heartbeat, or the
   reported running + waiting if larger), then the most free blocks, then the id (determinism).
4. A PrefillAndDecode worker serves alone (prefill None). A DecodeOnly worker is paired with the
   prefill candidate with the fewest queued prefill tokens (reported plus what the router sent since),
   unless no prefill candidate is alive or the prompt has at most ``max_local_prefill_length`` tokens
   (conditional disaggregation, Dynamo's idea: shipping the KV of a short prompt costs more than
   computing it where it will be decoded); then it prefills locally (prefill None). Ties between
   prefill workers go to the one the router has given the fewest prompt blocks to compute so far.
   With ``prefill_spill_tokens`` set, a DecodeOnly worker also prefills locally when the chosen prefill
   worker's backlog (queued prompt tokens: reported plus sent since) exceeds the decode worker's own
   backlog plus this prompt by at least that many tokens (Dynamo's queue-aware conditional
   disaggregation): at saturation the decode workers' idle compute takes prompts off a prefill queue
   that would start them later than a local prefill would finish them; below it nothing spills.
5. No decode candidate -> ``NoRoute`` with the reason (the HTTP layer answers 503); ``PromptTooLong`` (a 400,
   as a prompt past the model's context is) when decode-capable workers are there but none holds the prompt
   (their KV pools are shorter than the model's context: ``pipeline/kv_pool.servable_length``). Candidates that
   all run a full batch (router-side in-flight count >= their ``max_batch_size``) -> ``Saturated``
   (a ``NoRoute``): the request waits in the router's admission queue instead.

With KV-aware routing (``kv_overlap_weight`` set; ``router.kv_aware_routing``) rules 3 and 4 weigh
where the prompt's KV already lives (``num_cached_prompt_tokens``, from the router's KV index), in
Dynamo's form: ``cost = kv_overlap_weight x (prompt blocks the worker must compute or receive) +
(blocks its running requests hold)``, the latter the larger of its report and the router's own count
of what it sent there (each request's prompt plus its ``max_tokens``: the KV it may grow to). The decode worker is the cheapest (workers with free blocks first); the prefill
worker the one with the fewest prompt blocks to compute plus queued prefill blocks, both weighing 1 (its
cost is time: both are the same compute); and local prefill on
a DecodeOnly worker is decided on the prompt tokens it does not hold yet, not the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from pipeline.config import PipelineRole


@dataclass(frozen=True)
class WorkerView:
    """What the policy needs to know about one worker (a snapshot)."""

    worker_id: str
    role: PipelineRole
    max_length: int
    prefill_endpoint: str | None = None
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0
    num_inflight: int = 0  # router-side: routed here, not finished
    num_pending_prefill_tokens: int = 0  # router-side: prompt tokens sent here without a first token yet
    max_batch_size: int = 0  # requests it runs at once (0: unknown, never saturated)
    is_draining: bool = False  # shutting down: finishes what it has, takes nothing new
    page_size: int = 16
    num_cached_prompt_tokens: int = 0  # this request's leading prompt tokens its prefix cache holds
    num_inflight_blocks: int = 0  # router-side: blocks (prompt + max_tokens) of the requests routed here, not finished
    num_routed_prefill_blocks: int = 0  # router-side, cumulative: prompt blocks sent here to compute (prefill side)

    @property
    def is_saturated(self) -> bool:
        """Every slot of its running batch is taken by requests the router sent (new ones would queue there)."""
        return 0 < self.max_batch_size <= self.num_inflight


@dataclass(frozen=True)
class Route:
    decode: WorkerView
    prefill: WorkerView | None  # None: the decode worker prefills itself (colocated)
    is_spilled: bool = False  # a DecodeOnly worker prefills it because the prefill queue was too long (rule 4)


class NoRoute(Exception):
    """No live worker combination can serve the request; ``str()`` says why."""


class PromptTooLong(NoRoute):
    """Decode-capable workers are live, but none holds the prompt: ``longest`` is the most any of them holds."""

    def __init__(self, num_prompt_tokens: int, longest: int) -> None:
        super().__init__(f"the prompt has {num_prompt_tokens} tokens; the workers serving this model hold at most "
                         f"{longest} (their KV caches are shorter than the model's context)")
        self.longest = longest


class Saturated(NoRoute):
    """Workers can serve the request, but every one of them is saturated: wait for a free slot."""


def choose_route(
    workers: Sequence[WorkerView], num_tokens: int, exclude: Iterable[str] = (), *,
    num_prompt_tokens: int | None = None, max_local_prefill_length: int = 0,
    kv_overlap_weight: float | None = None, prefill_spill_tokens: int | None = None,
) -> Route:
    """Pick (prefill or None, decode) for a request needing ``num_tokens`` (prompt + max output)
    whose prompt has ``num_prompt_tokens`` (default: all of ``num_tokens``); ``kv_overlap_weight``
    None routes by load alone; ``prefill_spill_tokens`` None never spills a prompt to its decode worker."""
    excluded = set(exclude)
    num_prompt_tokens = num_tokens if num_prompt_tokens is None else num_prompt_tokens
    live = [w for w in workers if w.worker_id not in excluded and not w.is_draining]
    # a prefill worker computes the prompt and its first token only
    prefill = [w for w in live if w.role == PipelineRole.PrefillOnly and w.prefill_endpoint
               and w.max_length > num_prompt_tokens]
    decoders = [w for w in live if w.role in (PipelineRole.PrefillAndDecode, PipelineRole.DecodeOnly)]
    decode_candidates = [w for w in decoders if w.max_length >= num_tokens]
    if not decode_candidates:
        # none holds the whole output (a worker serves what its KV pool holds: pipeline/kv_pool.servable_length):
        # one that holds the prompt ends the output at its own max_length, finish_reason "length"
        decode_candidates = [w for w in decoders if w.max_length > num_prompt_tokens]
    if not decode_candidates and decoders:
        raise PromptTooLong(num_prompt_tokens, max(w.max_length for w in decoders))
    if not decode_candidates:
        raise NoRoute(_why_none(workers, excluded, num_tokens))
    decode_candidates = [w for w in decode_candidates if not w.is_saturated]
    if not decode_candidates:
        raise Saturated("every decode-capable worker is running a full batch")
    if kv_overlap_weight is None:
        decode = min(decode_candidates, key=_decode_key)
        uncached = num_prompt_tokens
    else:
        decode = min(decode_candidates, key=lambda w: _kv_decode_key(w, num_prompt_tokens, kv_overlap_weight))
        uncached = num_prompt_tokens - decode.num_cached_prompt_tokens
    if decode.role == PipelineRole.PrefillAndDecode or not prefill or uncached <= max_local_prefill_length:
        return Route(decode=decode, prefill=None)
    if kv_overlap_weight is None:
        chosen = min(prefill, key=_prefill_key)
    else:
        chosen = min(prefill, key=lambda w: _kv_prefill_key(w, num_prompt_tokens))
    if prefill_spill_tokens is not None and (
            prefill_backlog(decode) + uncached <= prefill_backlog(chosen) - prefill_spill_tokens):
        return Route(decode=decode, prefill=None, is_spilled=True)
    return Route(decode=decode, prefill=chosen)


def prefill_backlog(w: WorkerView) -> int:
    """Prompt tokens waiting for (or in) prefill on ``w``: its report plus what the router sent since."""
    return w.num_queued_prefill_tokens + w.num_pending_prefill_tokens


def choose_handoff_target(
    workers: Sequence[WorkerView], num_tokens: int, exclude: Iterable[str] = (), *, num_cached_tokens: int,
    kv_overlap_weight: float | None = None,
) -> WorkerView:
    """The DecodeOnly worker that takes a draining worker's stream with its KV (live migration): rule 3
    among DecodeOnly workers (only they receive KV), ``num_cached_tokens`` (prompt + tokens so far) the
    KV it would receive or hold. Raises ``NoRoute`` / ``Saturated`` when none can."""
    receivers = [w for w in workers if w.role == PipelineRole.DecodeOnly]
    if not receivers:
        raise NoRoute("no other DecodeOnly worker to receive the stream's KV")
    return choose_route(receivers, num_tokens, exclude, num_prompt_tokens=num_cached_tokens,
                        kv_overlap_weight=kv_overlap_weight).decode


def route_costs(route: Route, num_prompt_tokens: int, kv_overlap_weight: float | None) -> dict[str, float]:
    """What the chosen workers cost in ``choose_route``'s terms, and the prompt's blocks each holds (for a
    trace): the decode worker's requests (by load) or weighted new plus active blocks (KV-aware), and the
    prefill worker's blocks to compute, queued and new."""
    decode = route.decode
    costs: dict[str, float] = {"tandem.route.decode_cached_blocks": decode.num_cached_prompt_tokens // decode.page_size}
    if kv_overlap_weight is None:
        costs["tandem.route.decode_cost"] = _decode_key(decode)[1]
    else:
        costs["tandem.route.decode_cost"] = _kv_decode_key(decode, num_prompt_tokens, kv_overlap_weight)[1]
    if route.prefill is not None:
        prefill = route.prefill
        costs["tandem.route.prefill_cached_blocks"] = prefill.num_cached_prompt_tokens // prefill.page_size
        costs["tandem.route.prefill_cost"] = _kv_prefill_key(prefill, num_prompt_tokens)[0]
    return costs


def popular_prefix_gaps(workers: Sequence[WorkerView], route: Route) -> tuple[int, list[WorkerView]]:
    """(tokens, prefill workers): the longest prefix of the routed prompt that at least two decode-capable
    workers hold, and the other live prefill workers that lack it (KV-aware routing).

    A prefix several decode workers hold is shared across conversations (a system prompt: each
    conversation's own history lives on one decode worker). A prefill worker that lacks it loses every new
    conversation to one that holds it, and a conversation stays where its first turn ran: all of them
    would end up in one prefill worker's cache. The router has those workers warm it up instead
    (``WarmPrefix``), so new conversations spread by load."""
    held = sorted((w.num_cached_prompt_tokens for w in workers
                   if w.role in (PipelineRole.PrefillAndDecode, PipelineRole.DecodeOnly)), reverse=True)
    if route.prefill is None or len(held) < 2 or held[1] < route.prefill.page_size:
        return 0, []
    popular = held[1]
    lacking = [w for w in workers if w.role == PipelineRole.PrefillOnly and w.prefill_endpoint and not w.is_draining
               and w.worker_id != route.prefill.worker_id and w.num_cached_prompt_tokens < popular]
    return popular, lacking


def _decode_key(w: WorkerView) -> tuple:
    num_requests = max(w.num_inflight, w.num_running + w.num_waiting)
    return (w.num_free_blocks <= 0, num_requests, -w.num_free_blocks, w.worker_id)


def _blocks(num_tokens: int, page_size: int) -> int:
    return -(-max(num_tokens, 0) // max(page_size, 1))


def _kv_decode_key(w: WorkerView, num_prompt_tokens: int, weight: float) -> tuple:
    new_blocks = _blocks(num_prompt_tokens - w.num_cached_prompt_tokens, w.page_size)
    active_blocks = max(w.num_total_blocks - w.num_free_blocks, w.num_inflight_blocks)
    return (w.num_free_blocks <= 0, weight * new_blocks + active_blocks, w.worker_id)


def _kv_prefill_key(w: WorkerView, num_prompt_tokens: int) -> tuple:
    # A prefill worker's cost is time: the prompt tokens it must compute for this request and those queued
    # before it are the same work, so both weigh 1 (the overlap weight prices KV against memory load on
    # the decode side). A weight above 1 here would let the first worker to cache a shared system prompt
    # win every new conversation, whose later turns then stay: one prefill cache holding them all.
    new_blocks = _blocks(num_prompt_tokens - w.num_cached_prompt_tokens, w.page_size)
    queued_blocks = _blocks(prefill_backlog(w), w.page_size)
    return (new_blocks + queued_blocks, w.num_routed_prefill_blocks, w.worker_id)


def _prefill_key(w: WorkerView) -> tuple:
    # ties (idle prefill workers) go to the one that was given less to compute so far: with KV reuse, the
    # worker that takes a conversation's first turn computes its later ones too, so ties decide its home
    return (prefill_backlog(w), w.num_routed_prefill_blocks, w.worker_id)


def _why_none(workers: Sequence[WorkerView], excluded: set[str], num_tokens: int) -> str:
    usable = [w for w in workers if w.worker_id not in excluded]
    if not usable:
        return "no live workers" if not workers else "no other live worker to retry on"
    if all(w.is_draining for w in usable):
        return "every live worker is shutting down"
    usable = [w for w in usable if not w.is_draining]
    if all(w.max_length < num_tokens for w in usable):
        longest = max(w.max_length for w in usable)
        return f"no live worker accepts {num_tokens} tokens (prompt + max_tokens); the largest max_length is {longest}"
    return "no decode-capable (DecodeOnly or PrefillAndDecode) worker is alive"
