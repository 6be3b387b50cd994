"""Request state: what a prompt needs to be prefilled and what a sequence carries while decoding."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from app.errors import ContextLengthError, InvalidRequestError
from app.messages import FinishReason
from app.sampling import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the decoder's queue, KV not yet in the batch
    RUNNING = "running"  # holds KV blocks in the decode batch
    FINISHED = "finished"


def validate_prompt(
    prompt_token_ids: list[int] | tuple[int, ...],
    sampling: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    param: str = "prompt",
) -> None:
    """Raise a typed 400-class error unless the prompt can be served within the context."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty (0 tokens)", param=param)
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param
        )
    if n >= max_model_len:
        raise ContextLengthError(
            f"the prompt has {n} tokens; this model's context is {max_model_len} tokens and at "
            "least one must be left for the output",
            param=param,
        )
    if n + sampling.max_tokens > max_model_len:
        raise ContextLengthError(
            f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) = "
            f"{n + sampling.max_tokens} exceeds the model context of {max_model_len} tokens; "
            f"lower max_tokens to at most {max_model_len - n}",
            param="max_tokens",
        )
    sampling.check_vocab(vocab_size)


@dataclass(slots=True)
class Sequence:
    """One request inside the decoder. ``output_token_ids[0]`` is prefill's first token."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    blocks: list[int] = field(default_factory=list)  # block table while RUNNING
    kv_len: int = 0  # tokens whose KV sits in this sequence's blocks
    output_offset: int = 0  # see PrefillRequest.output_offset
    # time.perf_counter() when the decode loop took it (queued) and when it joined the batch
    enqueued_at: float | None = None
    joined_at: float | None = None
    last_logprobs: TokenLogprobs | None = None  # of the last token, when asked for
    matcher: Any = None  # a constrained answer's GrammarMatcher, from when it runs

    @property
    def next_step(self) -> int:
        """Sampling step (output index) of the token this sequence draws next."""
        return self.output_offset + self.num_output_tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def decode_queue_s(self) -> float | None:
        """Time between reaching the decode loop and joining its running batch."""
        if self.enqueued_at is None or self.joined_at is None:
            return None
        return self.joined_at - self.enqueued_at

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        """Every output token of the stream so far: those delivered before a resume (the
        prompt's last ``output_offset`` tokens), then this sequence's."""
        return self.prompt_token_ids[self.prompt_len - self.output_offset:] + self.output_token_ids

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1]

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence may hold at most: its KV reservation."""
        return self.prompt_len + self.sampling.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def append(self, token: int, *, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        """Record a sampled token and finish the sequence if it must stop here."""
        self.output_token_ids.append(token)
        p = self.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
            self.finish(FinishReason.STOP)
        elif self.num_output_tokens >= p.max_tokens:
            self.finish(FinishReason.LENGTH)
        elif self.prompt_len + self.num_output_tokens >= max_model_len:
            self.finish(FinishReason.LENGTH)
