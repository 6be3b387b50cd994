"""The messages that cross processes, in one place.

A request travels ingress -> prefill -> decode -> ingress as four messages:

* ``PrefillRequest`` (ingress -> prefill, or -> a decode replica that prefills locally): a
  tokenized, validated prompt with concrete sampling settings.
* ``KVPackage`` (prefill -> object store -> decode; defined in ``app.kv_package`` next to its
  tensor code): the prompt's KV cache, its first token (with its logprobs when asked for)
  and its sampling state.
* ``StreamStart`` (decode -> ingress, first item of every stream): where and how the KV
  package arrived.
* ``TokenEvent`` (decode -> ingress, every later item): one output token, or the end of the
  stream with its ``FinishReason``.

All are plain dataclasses (no Ray, no torch tensors except inside ``KVPackage``); Ray pickles
them between replicas. None of them is ever built from what a client sends without validation,
and none is ever unpickled from a client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from app.kv_package import KVPackage
from app.sampling import SamplingParams, TokenLogprobs

__all__ = ["FinishReason", "KVPackage", "PrefillRequest", "StreamStart", "TokenEvent"]


class FinishReason(str, enum.Enum):
    """Why a sequence ended. ``STOP`` and ``LENGTH`` reach clients as OpenAI's
    ``finish_reason``; the other two end a stream internally."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model context
    CANCELLED = "cancelled"  # the client went away or the caller cancelled
    ERROR = "error"  # the engine failed this sequence
    TOOL_CALLS = "tool_calls"  # an answer that is a forced tool call (app.tools), to clients

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """A tokenized prompt with its sampling settings (seed already concrete)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # Output tokens a client already received before this prompt was (re)built: a resumed
    # stream re-prefills prompt + those tokens, and sampling steps continue from here.
    output_offset: int = 0
    # Answers wanted (OpenAI's n): one prefill, a first token per answer (seeds seed + k)
    n: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def delivered_token_ids(self) -> tuple[int, ...]:
        """The output tokens the prompt ends with (a resumed stream's): the penalties count
        them as output."""
        return self.prompt_token_ids[self.num_tokens - self.output_offset:]


@dataclass(frozen=True, slots=True)
class StreamStart:
    """First item of every decode stream: where and how the KV package arrived."""

    node_id: str
    kv_bytes: int
    kv_hop_s: float  # prefill returned -> this replica holds the package
    fetch_s: float  # time spent resolving the ObjectRef here
    prefill_s: float  # compute time of the prefill passes that made the package
    local_prefill: bool = False  # prefilled by this decode replica (no KV hop)
    replica_id: str = ""  # the decode replica serving the stream
    prefill_done_at: float = 0.0  # time.time() when the prefill returned the package
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefill's prefix cache
    fed: bool = False  # the tokens go through the ingress's token feed, not this stream


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One output token of a sequence; ``finish_reason`` is set on its last event."""

    request_id: str
    token_id: int | None  # None only on an event that ends a stream without a token
    index: int  # output position of this token in the whole stream (0 = the first token)
    finish_reason: FinishReason | None = None
    error: str | None = None
    # set on a sequence's first decode-step token only: seconds it waited to join the batch
    decode_queue_s: float | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
