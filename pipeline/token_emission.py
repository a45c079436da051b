"""What one sampled token becomes: the ``StepOutput`` a request gets for it, its logprobs, and whether it ends the
request (a stop token or string, the length limit, a finished or refusing grammar).

``TokenEmitter`` is the one place a token is emitted, whichever path sampled it: a step run at once, the overlap
pipeline's read one step late, several tokens of a verified speculative draft, or the first token a prefill
worker computed (P/D). A finished request leaves the request table here (``RequestTable.finish``).
"""

from __future__ import annotations

import logging

from pipeline.output_processor import OutputProcessor
from pipeline.protocol import FinishReason
from pipeline.request_table import RequestTable
from pipeline.sequence import Sequence
from pipeline.step_output import StepOutput

logger = logging.getLogger(__name__)


class TokenEmitter:
    def __init__(self, requests: RequestTable, output_processor: OutputProcessor) -> None:
        self.requests = requests
        self.output_processor = output_processor

    def emit(self, seq: Sequence, token_id: int, logprobs: dict[int, float] | None,
             num_tokens: int | None = None) -> StepOutput:
        """The output of ``token_id``, already appended to ``seq`` (its ``num_tokens`` tokens so far, when the
        overlap pipeline reads it a step late), and the request's end if it is one."""
        self.requests.fork_waiting_choices(seq)
        out = StepOutput(seq.family_id, [token_id], num_prompt_tokens=seq.num_prompt_tokens,
                         num_cached_tokens=seq.num_cached_tokens, num_top_logprobs=seq.params.logprobs or 0,
                         index=seq.index)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
            out.new_logprobs = [logprobs]
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        stop = self.output_processor.check_stop(seq, token_id, num_tokens)
        out.is_stop_token = stop is not None and stop[0] == FinishReason.STOP.value and not isinstance(stop[1], str)
        grammar = seq.sampling_state.grammar
        if grammar is not None:
            if not grammar.accept(token_id) and (stop is None or stop[0] != FinishReason.LENGTH.value):
                # the mask allowed a token its matcher refuses: the output no longer satisfies the
                # constraint, and a refused token never ends a request as a success
                out.error = f"structured output: the grammar refused token {token_id} that its mask allowed"
                logger.error("request %s: %s", seq.request_id, out.error)
                stop = (FinishReason.ERROR.value, None)
                out.is_stop_token = False
            elif stop is None and grammar.is_finished:  # the constraint is complete: this token is its last text
                stop = (FinishReason.STOP.value, None)
            elif stop is not None and stop[0] == FinishReason.LENGTH.value and grammar.allows_only_the_end():
                # a whole answer that also reached max_tokens ("length" would make the openai SDK's parse()
                # refuse a complete document)
                stop = (FinishReason.STOP.value, None)
        if stop is not None:
            out.finish_reason, out.stop_reason = stop
            out.num_preemptions = seq.num_preemptions
            out.request_finished = self.requests.finish(seq, *stop, ended_by_stop_token=out.is_stop_token)
        return out

    def emit_tokens(self, seq: Sequence, token_ids: list[int],
                    logprobs: list[dict[int, float]] | None) -> StepOutput:
        """Append and emit several tokens of one request as one output; a stop drops the ones after it."""
        out = None
        for i, token_id in enumerate(token_ids):
            seq.append_token(token_id)
            one = self.emit(seq, token_id, logprobs[i] if logprobs is not None else None)
            if out is None:
                out = one
            else:
                out.extend(one)
            if one.finish_reason is not None:
                break
        return out
