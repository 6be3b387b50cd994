"""Structured outputs: a constraint (a JSON schema, any JSON object, a regex, a choice of
strings, a grammar) turned into a token mask on the logits of the rows that ask for one.

The grammar engine is llguidance (``pip install llguidance``: one self-contained wheel, no
further dependencies; vLLM and SGLang ship it as a backend beside xgrammar, which on Linux
pulls in triton, a GPU compiler this CPU-first engine does not otherwise need). It compiles
lazily, so a new schema costs little before its first mask, and a row's mask is cheap beside a
decode step (BENCHMARKS.md §9, "Structured outputs").

A constraint travels inside :class:`~app.sampling.SamplingParams` (plain strings: nothing
is pickled from a client), so both phases see it: the prefill replica masks the first token,
the decode replica rebuilds the matcher from the constraint and the tokens output so far
(the first, and after a resume every token already sent) and masks the rest. A matcher's
state is a function of those tokens alone, so a resumed answer continues with exactly the
masks it would have had.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from app.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. ``kind``: ``json`` (``spec``: a JSON schema as JSON text;
    ``{"type": "object"}`` for any JSON object), ``regex``, ``choice`` (a JSON list of the
    allowed strings) or ``grammar`` (Lark syntax, as llguidance reads it; GBNF is converted).
    ``param``: the request field it came from, for errors."""

    kind: str
    spec: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, param: str) -> Constraint:
        return cls("json", json.dumps(schema, sort_keys=True), param)

    @classmethod
    def choice(cls, options: list[str], param: str) -> Constraint:
        if not options or not all(isinstance(o, str) for o in options):
            raise InvalidRequestError(f"{param}: a choice needs a non-empty list of strings",
                                      param=param)
        return cls("choice", json.dumps(options), param)

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (checked: ``InvalidRequestError``)."""
        return _compile(self.kind, self.spec, self.param)


@functools.lru_cache(maxsize=256)
def _compile(kind: str, spec: str, param: str) -> str:
    import llguidance

    match = llguidance.LLMatcher
    try:
        if kind == "json":
            grammar = match.grammar_from_json_schema(json.loads(spec))
        elif kind == "regex":
            grammar = match.grammar_from_regex(spec)
        elif kind == "choice":
            alternatives = " | ".join(json.dumps(o) for o in json.loads(spec))
            grammar = match.grammar_from_lark(f"start: {alternatives}")
        else:
            from llguidance.gbnf_to_lark import any_to_lark  # Lark as it is, GBNF converted

            grammar = match.grammar_from_lark(any_to_lark(spec))
    except Exception as exc:  # whatever the compiler refuses is the client's 400
        raise InvalidRequestError(f"{param}: not a valid {kind} constraint: {exc}",
                                  param=param) from exc
    error = match.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{param}: not a valid {kind} constraint: {error}",
                                  param=param)
    return grammar


class Grammars:
    """One replica's grammar side: its tokenizer as llguidance sees it (loaded and converted
    once: in the replica's constructor, ``warm``, else on the first constrained answer, on
    the engine's thread) and a matcher per constrained answer. The end of an answer is the
    engine's EOS (the tokenizer's own where it is one of the engine's, else the lowest of
    them)."""

    def __init__(self, load_tokenizer: Callable[[], Any]) -> None:
        self._load = load_tokenizer
        self._tokenizer: Any = None
        self._ll: dict[int | None, Any] = {}
        self._lock = threading.Lock()

    def warm(self, eos_token_ids: frozenset[int]) -> None:
        """Convert the tokenizer now: a replica does it in its constructor, before it takes
        requests, so the first constrained answer does not hold the engine's thread for it.
        (Not on a thread of its own once serving: the conversion holds the GIL, and a
        replica that stalls its event loop that long just after starting is routed around:
        the autoscaling tests saw it.)"""
        self._ll_tokenizer(eos_token_ids)

    def _ll_tokenizer(self, eos_token_ids: frozenset[int]) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load()
            own = getattr(self._tokenizer, "eos_token_id", None)
            eos = own if own in eos_token_ids or not eos_token_ids else min(eos_token_ids)
            if eos not in self._ll:
                import llguidance.hf

                self._ll[eos] = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=eos)
            return self._ll[eos]

    def matcher(self, constraint: Constraint, tokens: list[int] | tuple[int, ...] = (),
                eos_token_ids: frozenset[int] = frozenset()) -> GrammarMatcher:
        """A matcher for ``constraint`` that has consumed ``tokens`` (an answer's output so
        far: a decode replica's first token, a resumed stream's delivered ones)."""
        import llguidance

        ll = self._ll_tokenizer(eos_token_ids)
        m = llguidance.LLMatcher(ll, constraint.grammar())
        if tokens and m.try_consume_tokens(list(tokens)) != len(tokens):
            raise InvalidRequestError(f"{constraint.param}: the output so far does not match "
                                      "the constraint", param=constraint.param)
        return GrammarMatcher(m, ll.vocab_size)


class GrammarMatcher:
    """One answer's position in its grammar: the mask of the tokens allowed next, and the
    token drawn (``accept``)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch as lt

        self._m = matcher
        self._vocab = vocab_size
        self._bits = lt.allocate_token_bitmask(1, vocab_size)

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """``row`` [V] float32 (changed in place, returned) with every token the grammar does
        not allow next at -inf (and ids past the tokenizer's vocabulary: padding)."""
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self._m, self._bits, 0)
        head = row[: self._vocab].view(1, -1)
        lt.apply_token_bitmask_inplace(head, self._bits)
        if row.shape[0] > self._vocab:
            row[self._vocab:] = float("-inf")
        return row

    def accept(self, token: int) -> None:
        """Advance past ``token`` (drawn under :meth:`mask`)."""
        if not self._m.consume_token(token):
            raise RuntimeError(f"grammar refused token {token}: {self._m.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (the answer ends here)."""
        return bool(self._m.is_stopped())
