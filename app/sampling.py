"""Sampling parameters and the batched sampler.

Randomness is counter-based: the token at output index ``t`` of a request with seed ``s`` is
drawn from a generator seeded with ``(s, t)``. A seeded request therefore gets the same tokens
whatever else shares its batch, and the whole sampling state that travels in a KV package (or
that a resumed stream needs) is two integers.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import torch

from app.errors import InvalidRequestError

_MAX_STOP_STRINGS = 16
GREEDY_EPS = 1e-5  # temperatures below this sample greedily
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    ``temperature == 0`` means greedy. ``seed`` None is replaced by a random seed at admission
    (:meth:`with_seed`), so a stream that resumes elsewhere continues the same random sequence.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= _SEED_MASK:
            raise bad("seed", f"must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise bad("stop", f"at most {_MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        # a temperature this small divides logits to inf: it means greedy
        return self.temperature < GREEDY_EPS

    def with_seed(self) -> SamplingParams:
        """This request with a concrete seed (random when none was given)."""
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))

    def for_choice(self, k: int) -> SamplingParams:
        """The settings of answer ``k`` of a request for several (OpenAI's ``n``): its own
        seed, ``seed + k``; answer 0 is the request itself. Greedy answers are all alike."""
        if k == 0 or (self.seed is None and self.greedy):
            return self
        assert self.seed is not None, "seed set at admission"
        return replace(self, seed=(self.seed + k) % (1 << 63))

    def check_vocab(self, vocab_size: int) -> None:
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids: {t} is outside the vocabulary (size {vocab_size})",
                    param="stop_token_ids",
                )


def _step_seed(seed: int, step: int) -> int:
    # splitmix64-style mixing of (seed, step) so neighbouring steps get unrelated streams.
    x = (seed ^ (step * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & _SEED_MASK


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    steps: list[int],
    history: list[list[int]] | None = None,
) -> list[int]:
    """Pick one token per row.

    logits: [B, V] (any float dtype); params, steps: length B. ``steps[i]`` is the output index
    of the token being drawn for row i (0 for the first token). ``history[i]`` are the token ids
    seen so far by row i (prompt + output), used only for the repetition penalty.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(steps)
    logits = logits.float()
    out: list[int] = [0] * len(params)
    plain_greedy = [
        i for i, p in enumerate(params) if p.greedy and p.repetition_penalty == 1.0
    ]
    if plain_greedy:
        idx = torch.tensor(plain_greedy, device=logits.device)
        picked = logits.index_select(0, idx).argmax(dim=-1).tolist()
        for i, tok in zip(plain_greedy, picked, strict=True):
            out[i] = tok
    done = set(plain_greedy)
    for i, p in enumerate(params):
        if i in done:
            continue
        row = logits[i]
        if p.repetition_penalty != 1.0 and history is not None and history[i]:
            seen = torch.tensor(sorted(set(history[i])), device=row.device)
            vals = row.index_select(0, seen)
            vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            row = row.index_copy(0, seen, vals)
        if p.greedy:
            out[i] = int(row.argmax())
            continue
        out[i] = _sample_row(row, p, steps[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, step: int) -> int:
    # row: [V] float32
    assert p.seed is not None, "seed is set at admission (SamplingParams.with_seed)"
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cum - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    gen = torch.Generator(device=row.device)
    gen.manual_seed(_step_seed(p.seed, step))
    return int(torch.multinomial(probs, 1, generator=gen))
