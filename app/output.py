"""Turning a decoder's token events into text deltas (detokenization, stop strings)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from app.detokenizer import IncrementalDetokenizer
from app.errors import EngineError
from app.messages import FinishReason, TokenEvent
from app.sampling import SamplingParams, TokenLogprobs


class GenerationFailed(EngineError):
    """The engine ended a stream with an error (HTTP 500 / an error event)."""

    error_type = "server_error"
    status_code = 500


@dataclass(frozen=True, slots=True)
class LogprobText:
    """One output token's logprob and its position's most likely tokens, with tokens as
    the text the API shows."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, lp: TokenLogprobs, tokenizer) -> LogprobText:
        def text(token_id: int) -> str:
            return tokenizer.decode([token_id])

        return cls(text(lp.token_id), lp.logprob, tuple((text(t), v) for t, v in lp.top))


@dataclass(slots=True)
class StreamDelta:
    """New output since the previous delta. ``finish_reason`` is set on the last one;
    ``logprobs``, when the request asked for them, has one entry per token id."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[LogprobText] | None = None


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None

    @property
    def usage(self) -> dict[str, int]:
        n_in, n_out = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


async def text_deltas(
    events: AsyncIterator[TokenEvent], tokenizer, sampling: SamplingParams
) -> AsyncIterator[StreamDelta]:
    """Detokenize a token stream; stop early (closing ``events``) when a stop string appears
    past the first ``min_tokens`` tokens (counted by the events' whole-stream index, so a
    resumed stream counts the tokens delivered before its resume)."""
    detok = IncrementalDetokenizer(tokenizer, sampling.stop, min_tokens=sampling.min_tokens)
    try:
        async for ev in events:
            if ev.error is not None:
                raise GenerationFailed(f"generation failed: {ev.error}")
            ids = [] if ev.token_id is None else [ev.token_id]
            text = detok.add(ev.token_id, ev.index) if ev.token_id is not None else ""
            lps = None if ev.logprobs is None else [LogprobText.of(ev.logprobs, tokenizer)]
            if detok.stopped:
                yield StreamDelta(text, ids, FinishReason.STOP, lps)
                return
            if ev.finish_reason is not None:
                yield StreamDelta(text + detok.finish(), ids, ev.finish_reason, lps)
                return
            if text or ids:
                yield StreamDelta(text, ids, logprobs=lps)
        raise GenerationFailed("the token stream ended without a finish reason")
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
