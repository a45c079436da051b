"""The overlap pipeline's bookkeeping: one step launched and not yet read (MAX's overlap scheduler).

With ``enable_overlap_scheduler`` the engine's ``step()`` launches step N on the execution stream
(``pipeline/execution_stream.py``) and then reads step N-1's tokens, so the host schedules step N,
builds its inputs and processes step N-1's outputs while the model computes. MAX's contract:
``step()`` returns the *previous* batch's outputs, the first call returns nothing,
``has_pending_outputs()`` says whether a launched step is still unread, and a call with nothing to
schedule drains. With overlap off, each step is read before ``step()`` returns.

What changes for a request while its step is in flight:

* its length advances at launch: the sampled token is a placeholder (``PLACEHOLDER_TOKEN_ID``),
  filled when the step is read; the next step's input for it is copied on the device
  (``ModelRunner.launch``), never through the host;
* its full blocks are published to the prefix cache when the step is read, once every token in them
  is known;
* a stop (EOS, stop token, stop string) is seen one step late: the token the next step sampled for it
  is dropped, and its blocks were freed once, when it finished; an abort frees them at once, and the
  step's output for it is ignored;
* a request whose next step needs its previous token values on the host (penalties and bad words
  read the output so far) makes the engine read the step in flight before scheduling the next one;
* structured output keeps overlapping: step N+1 is launched, step N's tokens are read and each
  grammar's matcher advances, and only then are step N+1's masks filled (beside its forward, on the
  mask thread); its sampling waits for them.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from pipeline.scheduler import SchedulerOutput
from pipeline.sequence import Sequence


@dataclass
class InFlightStep:
    """A launched step: its plan, the Future of its sampled tokens, and where each token goes."""

    plan: SchedulerOutput
    future: Future  # SamplerOutput | None
    sampled: list[Sequence]  # the requests that sample in this step, in sampler row order
    positions: list[int]  # the index in each one's token_ids of its placeholder
    needs_host_tokens: bool  # a request's next step needs these token values on the host: read before scheduling

    def wait_and_drop(self) -> None:
        """A step failed, so this one (launched on tokens never sampled, or the failed one) is never read: wait for
        it to end, so the execution stream is free, ignoring what it raises."""
        try:
            self.future.result()
        except BaseException:  # noqa: BLE001 - the earlier step's failure is the one raised
            pass


def needs_host_tokens(seq: Sequence) -> bool:
    """Whether ``seq``'s next step reads its output token values on the host: repetition, frequency and
    presence penalties and bad words do (logit bias, allowed tokens, min_tokens and seeds need lengths
    only; grammar masks are filled after the step in flight is read: ``LLMEngine.step``)."""
    params = seq.params
    state = seq.sampling_state
    return bool(params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
                or (state is not None and state.bad_words_token_ids))
