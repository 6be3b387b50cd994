"""Sampling parameters and the batched sampler.

Randomness is counter-based: the token at output index ``t`` of a request with seed ``s`` is
drawn from a generator seeded with ``(s, t)``. A seeded request therefore gets the same tokens
whatever else shares its batch, and the whole sampling state that travels in a KV package (or
that a resumed stream needs) is two integers plus the tokens already output: a resumed
stream's prompt ends with those tokens (``output_offset`` of them), so the penalties that
count output tokens and ``min_tokens`` see the same history after a resume.

One row's logits go through, in vLLM's order: ``min_tokens`` (EOS and stop tokens masked),
``logit_bias``, the penalties (repetition over prompt + output, frequency and presence over
the output), then greedy argmax or temperature, ``top_k``, ``min_p``, ``top_p`` and a seeded
draw. A row with none of these set takes the batched argmax, unchanged.

Logprobs (``logprobs``) are those of the model's raw distribution, before any of the above:
vLLM's default (``logprobs_mode="raw_logprobs"``). They are computed only for rows that ask.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import torch

from app.errors import InvalidRequestError
from app.structured import Constraint, GrammarMatcher

_MAX_STOP_STRINGS = 16
GREEDY_EPS = 1e-5  # temperatures below this sample greedily
_SEED_MASK = (1 << 63) - 1
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_LOGPROBS = 20  # alternatives per token (OpenAI chat's top_logprobs bound)
_LOGPROB_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps to the same value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, validated on construction.

    ``temperature == 0`` means greedy. ``seed`` None is replaced by a random seed at admission
    (:meth:`with_seed`), so a stream that resumes elsewhere continues the same random sequence.
    ``max_tokens`` counts this request's own output (a resumed request asks for what is
    left); ``min_tokens`` counts the whole stream's output index, so a resume keeps it as is.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the top k
    constraint: Constraint | None = None  # structured output (app.structured)

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got "
                      f"{len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise bad("logit_bias", f"token ids must be >= 0, got {token}")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"biases must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        # a temperature this small divides logits to inf: it means greedy
        return self.temperature < GREEDY_EPS

    @property
    def counts_output(self) -> bool:
        """Whether sampling needs the tokens output so far (frequency or presence penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """No logits processing before the draw (nothing but temperature and top-k/p/min-p)."""
        return (self.repetition_penalty == 1.0 and not self.counts_output
                and not self.logit_bias and self.min_tokens == 0 and self.constraint is None)

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
        for param, ids in (("stop_token_ids", self.stop_token_ids),
                           ("logit_bias", [t for t, _ in self.logit_bias])):
            for t in ids:
                if t >= vocab_size:
                    raise InvalidRequestError(
                        f"{param}: {t} is outside the vocabulary (size {vocab_size})",
                        param=param,
                    )


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The raw logprob of one output token and the ``top`` most likely tokens at its
    position, most likely first, as (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
    outputs: list[list[int]] | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
    matchers: list[GrammarMatcher | None] | None = None,
) -> list[int]:
    """Pick one token per row.

    logits: [B, V] (any float dtype); params, steps: length B. ``steps[i]`` is the output index
    of the token being drawn for row i (0 for the first token). ``history[i]`` are the token ids
    seen so far by row i (prompt + output), used only for the repetition penalty;
    ``outputs[i]`` the output tokens so far (every earlier output index), used only for the
    frequency and presence penalties. ``eos_token_ids`` are masked with the stop tokens
    while a row is under its ``min_tokens``. ``matchers[i]`` (rows with a constraint): the
    tokens its grammar does not allow are masked after the penalties, and it consumes the
    token drawn.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(steps)
    logits = logits.float()
    out: list[int] = [0] * len(params)
    plain_greedy = [i for i, p in enumerate(params) if p.greedy and p.plain]
    if len(plain_greedy) == len(params):  # every row: one argmax over the whole batch
        return greedy_tokens(logits)
    if plain_greedy:
        idx = torch.tensor(plain_greedy, device=logits.device)
        picked = greedy_tokens(logits.index_select(0, idx))
        for i, tok in zip(plain_greedy, picked, strict=True):
            out[i] = tok
    done = set(plain_greedy)
    for i, p in enumerate(params):
        if i in done:
            continue
        row = logits[i]
        if not p.plain:
            row = process_logits(row, p, steps[i], history[i] if history else None,
                                 outputs[i] if outputs else None, eos_token_ids)
        matcher = matchers[i] if matchers else None
        if matcher is not None:
            row = matcher.mask(row)
        out[i] = int(row.argmax()) if p.greedy else _sample_row(row, p, steps[i])
        if matcher is not None:
            matcher.accept(out[i])
    return out


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of ``logits`` [B, V] float32: the first of equal maxima (a NaN counts
    as the maximum), as ``torch.argmax``. On the CPU through numpy's, about a tenth of the
    time (SmolLM2's vocabulary: 4 against 44 us a row)."""
    if logits.device.type == "cpu":
        return logits.contiguous().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def process_logits(row: torch.Tensor, p: SamplingParams, step: int, seen: list[int] | None,
                   output: list[int] | None, eos_token_ids: frozenset[int]) -> torch.Tensor:
    """``row`` after min_tokens, logit_bias and the penalties (a new tensor; [V] float32)."""
    row = row.clone()
    if step < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if stops:
            row[torch.tensor(sorted(stops), device=row.device)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
        row.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=row.device))
    if p.repetition_penalty != 1.0 and seen:
        ids = torch.tensor(sorted(set(seen)), device=row.device)
        vals = row.index_select(0, ids)
        row[ids] = torch.where(vals > 0, vals / p.repetition_penalty,
                               vals * p.repetition_penalty)
    if p.counts_output and output:
        ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
        row.index_add_(0, ids, -(p.frequency_penalty * counts.float() + p.presence_penalty))
    return row


def _sample_row(row: torch.Tensor, p: SamplingParams, step: int) -> int:
    # row: [V] float32
    assert p.seed is not None, "seed is set at admission (SamplingParams.with_seed)"
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        # keep the tokens at least min_p times as likely as the most likely one (a ratio:
        # the same before or after top-k, which keeps the most likely token)
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
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


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                   tokens: list[int]) -> list[TokenLogprobs | None]:
    """Per row, the raw logprobs of ``tokens[i]`` and of the ``params[i].logprobs`` most
    likely tokens; None for rows that did not ask (no log-softmax runs when none did)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    idx = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))
    k = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen_l, vals_l, ids_l = chosen[:, 0].tolist(), top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(
            tokens[i], max(chosen_l[j], _LOGPROB_FLOOR),
            tuple((t, max(v, _LOGPROB_FLOOR)) for t, v in zip(ids_l[j][:n], vals_l[j][:n],
                                                              strict=True)))
    return out
