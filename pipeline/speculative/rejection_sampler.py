"""Verification of drafted tokens by modified rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

A cheap draft model proposes ``k`` tokens ``d_0 .. d_{k-1}``, each sampled from its distribution
``q_j``. One forward of the target model over the drafted prefix gives the target's distributions
``p_0 .. p_k`` at those positions plus one more (the "bonus" position after the last draft). For each
request this module decides how many drafts to keep and which single target token follows them.

Sampling requests, for ``j = 0 .. k-1`` in order:

1. Draw ``u ~ U[0, 1)`` and accept ``d_j`` when ``u * q_j(d_j) <= p_j(d_j)``, i.e. with probability
   ``min(1, p_j(d_j) / q_j(d_j))``.
2. On the first rejection, emit one "recovery" token sampled from the residual
   ``normalize(max(0, p_j - q_j))`` and stop.
3. If all ``k`` drafts are accepted, emit a bonus token sampled from ``p_k``.

Why the output is distributed exactly as the target's: for one position, the chance of emitting ``x``
is ``q(x) * min(1, p(x)/q(x)) + P(reject) * r(x)`` where ``r = max(0, p - q) / Z``. The first term is
``min(q(x), p(x))``; the rejection probability is ``1 - sum_y min(q(y), p(y)) = sum_y max(0, p(y) - q(y))
= Z``, so the second term is ``max(0, p(x) - q(x))``. Their sum is ``min(q, p) + max(0, p - q) = p(x)``.
Applied position by position (each ``p_j`` is conditioned on the accepted prefix, which equals the
drafted prefix up to ``j``), the emitted sequence has the target's joint distribution; after a
rejection nothing later is kept, and after ``k`` acceptances the bonus token is a plain sample from
``p_k``. So each call emits 1 .. k + 1 tokens, all distributed as if sampled from the target alone.

Edge cases, all well defined:

* ``p_j(d_j) == 0``: always rejected (also when ``u`` is exactly 0), so a token the target rules out
  (e.g. outside its top-k) is never accepted; the residual gives it no mass either.
* ``q_j(d_j) == 0`` but ``p_j(d_j) > 0``: cannot happen for a token really drawn from ``q_j``; if the
  caller's ``q_j`` says so anyway (rounding, different processing) the draft is accepted, as the limit
  ``p / q -> inf`` suggests.
* residual all zero: only when ``p_j <= q_j`` everywhere, i.e. ``p_j == q_j`` numerically, where a
  rejection is impossible except through the ``p_j(d_j) == 0`` rule; the recovery token is then
  sampled from ``p_j`` itself.

Greedy requests skip all randomness: draft ``j`` is accepted while it equals the target's argmax at
row ``j``; the first mismatch emits the target's argmax there, and if all match the bonus row's argmax
follows.

Randomness: each target row has its own generator (or the global one). Row ``j`` draws, in this order, one
uniform (drafted rows ``j < k`` only; every drafted row of a sampling request draws it) and then one
``[vocab]`` Exp(1) tensor, only if that row emits a sampled token (recovery or bonus). Categorical draws
use the exponential race ``argmax(probs / E)``, which picks ``i`` with probability ``probs_i / sum(probs)``
without normalizing.

Seeded requests take the **coupled** path instead, so that what they emit does not depend on where a
speculation window began (which follows prompt chunking, the step budget and the batch): row ``j``'s
generator is the plain sampler's for that output position, and the target's token there is
``t_j = argmax(p_j / E_j)``, exactly the token sampling without speculation draws. Draft ``j`` is kept when it
equals ``t_j``; the first that does not is replaced by ``t_j``, and after ``k`` kept drafts the bonus row's
``t_k`` follows. Every emitted token is the target's own sample, so the output is the target's distribution and,
for a seed, the very tokens of the run without a draft. The draft proposes from the same noise
(``argmax(q_j / E_j)``), so it is kept whenever ``q_j`` and ``p_j`` agree on the race's winner: a lower
acceptance than rejection sampling's ``sum min(p, q)`` where the two differ, the price of reproducibility.
"""

from __future__ import annotations

import torch

__all__ = ["rejection_sample"]


def rejection_sample(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    is_greedy: list[bool],
    generators: list[torch.Generator | None],
    global_generator: torch.Generator | None = None,
    is_coupled: list[bool] | None = None,
) -> list[list[int]]:
    """Verify each request's drafted tokens; return per request the accepted drafts plus one target token.

    Args:
        target_probs: [num_target_rows, vocab] float32. Per request, ``k_i + 1`` rows concatenated in
            request order: row ``j < k_i`` is ``p_j`` at drafted position ``j``, row ``k_i`` the bonus
            position. Fully processed (temperature, top-k/top-p applied; rows sum to 1). Rows of greedy
            requests are not read.
        target_argmax: [num_target_rows] int64, the target's greedy token per row (greedy requests only).
        draft_probs: [num_draft_rows, vocab] float32. Per request ``k_i`` rows: ``q_j``, the distribution
            draft ``j`` was sampled from. Rows of greedy requests are not read (may be zeros).
        draft_token_ids: [num_draft_rows] int64, the drafted tokens.
        num_draft_tokens: ``k_i`` per request; 0 means plain sampling of one token from the bonus row.
        is_greedy: per request.
        generators: one per target row (same order as ``target_probs``); None uses ``global_generator``
            (and None there uses torch's default generator of the probabilities' device).
        global_generator: the generator for rows without their own.
        is_coupled: per request, whether it takes the coupled path (a seeded request: its rows' generators are the
            plain sampler's, its ``target_probs`` rows the weights the plain sampler races on, normalized or not).

    Returns:
        Per request, ``1 .. k_i + 1`` token ids: the accepted drafts followed by exactly one target token.
    """
    _check_shapes(target_probs, target_argmax, draft_probs, draft_token_ids, num_draft_tokens, is_greedy,
                  generators)
    # One device-to-host copy each instead of one per request.
    target_argmax_list: list[int] = target_argmax.tolist()
    draft_token_list: list[int] = draft_token_ids.tolist()

    outputs: list[list[int]] = []
    target_start = 0  # first target row of the current request
    draft_start = 0  # first draft row of the current request
    for k, greedy, coupled in zip(num_draft_tokens, is_greedy, is_coupled or [False] * len(is_greedy)):
        drafts = draft_token_list[draft_start:draft_start + k]
        if greedy:
            outputs.append(_verify_greedy(drafts, target_argmax_list[target_start:target_start + k + 1]))
        elif coupled:
            outputs.append(_verify_coupled(target_probs[target_start:target_start + k + 1], drafts,
                                           generators[target_start:target_start + k + 1]))
        else:
            row_generators = [g if g is not None else global_generator
                              for g in generators[target_start:target_start + k + 1]]
            outputs.append(_verify_sampled(
                target_probs[target_start:target_start + k + 1],  # [k + 1, vocab]
                draft_probs[draft_start:draft_start + k],  # [k, vocab]
                draft_token_ids[draft_start:draft_start + k],  # [k]
                drafts,
                row_generators,
            ))
        target_start += k + 1
        draft_start += k
    return outputs


def _check_shapes(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    is_greedy: list[bool],
    generators: list[torch.Generator | None],
) -> None:
    if len(is_greedy) != len(num_draft_tokens):
        raise ValueError(f"got {len(is_greedy)} is_greedy flags for {len(num_draft_tokens)} requests")
    if any(k < 0 for k in num_draft_tokens):
        raise ValueError(f"negative draft count in {num_draft_tokens}")
    num_draft_rows = sum(num_draft_tokens)
    num_target_rows = num_draft_rows + len(num_draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_target_rows:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [{num_target_rows}, vocab]")
    if draft_probs.dim() != 2 or draft_probs.shape[0] != num_draft_rows:
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected [{num_draft_rows}, vocab]")
    if draft_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(f"draft vocab {draft_probs.shape[1]} != target vocab {target_probs.shape[1]}")
    if tuple(target_argmax.shape) != (num_target_rows,):
        raise ValueError(f"target_argmax has shape {tuple(target_argmax.shape)}, expected [{num_target_rows}]")
    if tuple(draft_token_ids.shape) != (num_draft_rows,):
        raise ValueError(f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, expected [{num_draft_rows}]")
    if len(generators) != num_target_rows:
        raise ValueError(f"got {len(generators)} generators for {num_target_rows} target rows")


def _verify_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """``drafts``: k tokens; ``target_argmax``: k + 1 tokens. Keep drafts while they match the argmax."""
    for j, draft in enumerate(drafts):
        if draft != target_argmax[j]:
            return drafts[:j] + [target_argmax[j]]
    return drafts + [target_argmax[len(drafts)]]


def _verify_coupled(target_weights: torch.Tensor, drafts: list[int],
                    generators: list[torch.Generator | None]) -> list[int]:
    """One seeded request: the target's own sample at each row in turn, drafts kept while they equal it."""
    for j, draft in enumerate(drafts):
        token = _sample_categorical(target_weights[j], generators[j])
        if token != draft:
            return drafts[:j] + [token]
    return drafts + [_sample_categorical(target_weights[len(drafts)], generators[len(drafts)])]


def _verify_sampled(
    target_probs: torch.Tensor,  # [k + 1, vocab]
    draft_probs: torch.Tensor,  # [k, vocab]
    draft_token_ids: torch.Tensor,  # [k] int64
    drafts: list[int],  # the same k tokens, on the host
    generators: list[torch.Generator | None],  # k + 1, one per target row
) -> list[int]:
    """One sampling request: accepted drafts, then a recovery token (first rejection) or the bonus token."""
    k = len(drafts)
    num_accepted = k
    if k > 0:
        uniforms = torch.stack([_uniform(g, target_probs.device) for g in generators[:k]])  # [k]
        index = draft_token_ids[:, None]  # [k, 1]
        p_at_draft = target_probs[:k].gather(1, index).squeeze(1)  # [k]
        q_at_draft = draft_probs.gather(1, index).squeeze(1)  # [k]
        accepted = _accept(uniforms, p_at_draft, q_at_draft)  # [k] bool
        # Position of the first rejection, or k when all are accepted (one host sync per request).
        num_accepted = int(torch.cumprod(accepted, dim=0).sum())
    if num_accepted < k:
        j = num_accepted
        probs = _residual(target_probs[j], draft_probs[j])  # [vocab]
    else:
        probs = target_probs[k]  # [vocab], the bonus position
    token = _sample_categorical(probs, generators[num_accepted])
    return drafts[:num_accepted] + [token]


def _accept(uniforms: torch.Tensor, p_at_draft: torch.Tensor, q_at_draft: torch.Tensor) -> torch.Tensor:
    """[k] each -> [k] bool: accept with probability min(1, p/q).

    ``u * q <= p`` avoids dividing by ``q``: with ``q == 0`` and ``p > 0`` it accepts. ``p > 0`` is
    required too, so a token the target gives no mass is rejected even when ``u`` is exactly 0.
    """
    return (p_at_draft > 0) & (uniforms * q_at_draft <= p_at_draft)


def _residual(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """[vocab] each -> [vocab] unnormalized ``max(0, p - q)``, or ``p`` when that is all zero.

    The exponential race does not need normalized weights, and ``torch.where`` on the device avoids a
    host sync to test for the all-zero case.
    """
    residual = (target_row - draft_row).clamp_min(0.0)  # [vocab]
    return torch.where(residual.sum() > 0, residual, target_row)


def _uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One U[0, 1) scalar drawn from ``generator`` (torch's default generator on ``device`` when None)."""
    draw_device = generator.device if generator is not None else device
    return torch.rand((), generator=generator, device=draw_device).to(device)


def _sample_categorical(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Token index sampled with probability proportional to ``weights`` [vocab] (non-negative, not all zero).

    Exponential race: ``argmax(w_i / E_i)`` with ``E_i ~ Exp(1)`` picks ``i`` with probability
    ``w_i / sum(w)``. The [vocab] noise is drawn on the generator's own device, so the draw is the same
    wherever the row sits in the batch.
    """
    draw_device = generator.device if generator is not None else weights.device
    noise = torch.empty(weights.shape[0], device=draw_device).exponential_(generator=generator)  # [vocab]
    # Exp(1) can return exactly 0; a tiny floor avoids 0/0 on zero-weight tokens.
    noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny).to(weights.device)
    return int((weights / noise).argmax())
