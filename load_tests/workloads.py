"""What the load generator sends and when: request classes, length distributions, synthetic
prompts of an exact token count, JSONL prompt files and arrival processes.

A *class* is a kind of request (``decode``: short prompt, long output; ``docs``: long prompt,
short output ...); each class is reported on its own. A *stream* issues requests: either one
shared stream (``--rate`` / ``--concurrency``) that draws each request's class by weight, or a
class's own stream when its spec names a rate or a concurrency.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WORD = re.compile(r" [a-z]{3,10}")


# ---- lengths -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token count: fixed, uniform on [low, high], or lognormal(median, sigma) clipped to
    [low, high].

    Spec strings: ``64``, ``uniform:32:256``, ``lognormal:128:0.8`` or
    ``lognormal:128:0.8:8:1024`` (median, sigma, low, high).
    """

    kind: str  # "fixed" | "uniform" | "lognormal"
    low: int
    high: int
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths must satisfy 1 <= low <= high, got {self.low}, {self.high}")

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls("fixed", n, n)

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        if isinstance(spec, int) or str(spec).isdigit():
            return cls.fixed(int(spec))
        kind, *parts = str(spec).split(":")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"bad length {spec!r}") from None
        if kind == "uniform" and len(nums) == 2:
            return cls("uniform", int(nums[0]), int(nums[1]))
        if kind == "lognormal" and len(nums) in (2, 4):
            median, sigma = nums[0], nums[1]
            low, high = (int(nums[2]), int(nums[3])) if len(nums) == 4 else (1, int(8 * median))
            if median <= 0 or sigma < 0:
                raise ValueError(f"bad length {spec!r}: median > 0 and sigma >= 0 needed")
            return cls("lognormal", low, high, median, sigma)
        raise ValueError(f"bad length {spec!r}: expected N, uniform:LOW:HIGH or "
                         "lognormal:MEDIAN:SIGMA[:LOW:HIGH]")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        n = round(math.exp(rng.gauss(math.log(self.median), self.sigma)))
        return min(self.high, max(self.low, n))

    @property
    def max(self) -> int:
        return self.high


# ---- classes -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request and, optionally, its own arrival stream and bound."""

    name: str
    input_len: LengthDist | None  # None: prompts come from a file
    output_len: LengthDist
    weight: float = 1.0  # share of the shared stream's requests
    rate: float | None = None  # own Poisson stream (requests/s)
    concurrency: int | None = None  # own closed loop of this many clients
    num_requests: int | None = None  # own bound (own stream only)
    background: bool = False  # own stream stops issuing once every foreground stream is done
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if not self.name or not re.fullmatch(r"[\w.-]+", self.name):
            raise ValueError(f"bad class name {self.name!r}")
        if self.weight <= 0:
            raise ValueError(f"class {self.name}: weight must be positive")
        if self.rate is not None and self.concurrency is not None:
            raise ValueError(f"class {self.name}: give rate or concurrency, not both")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"class {self.name}: rate must be positive")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"class {self.name}: concurrency must be >= 1")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"class {self.name}: n must be >= 1")
        if (self.num_requests is not None or self.background) and not self.own_stream:
            raise ValueError(f"class {self.name}: n= and background need rate= or "
                             "concurrency= (the class's own stream)")

    @property
    def own_stream(self) -> bool:
        return self.rate is not None or self.concurrency is not None

    @classmethod
    def parse(cls, spec: str, *, ignore_eos: bool = True) -> RequestClass:
        """``name=docs,input=1024,output=16,rate=0.5,n=10`` (keys: name, input, output,
        weight, rate, concurrency, n, background, ignore_eos); a bare ``chat`` is the chat-like
        preset."""
        if spec in PRESETS:
            return PRESETS[spec]
        fields: dict[str, str] = {}
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"bad class spec {spec!r}: {item!r} is not KEY=VALUE")
            fields[key.strip()] = value.strip()
        known = {"name", "input", "output", "weight", "rate", "concurrency", "n", "background",
                 "ignore_eos"}
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"bad class spec {spec!r}: unknown keys {sorted(unknown)}")
        if "name" not in fields or "output" not in fields:
            raise ValueError(f"bad class spec {spec!r}: name= and output= are required")

        def flag(value: str) -> bool:
            return value.lower() in ("1", "true", "yes", "on")

        return cls(
            name=fields["name"],
            input_len=LengthDist.parse(fields["input"]) if "input" in fields else None,
            output_len=LengthDist.parse(fields["output"]),
            weight=float(fields.get("weight", 1.0)),
            rate=float(fields["rate"]) if "rate" in fields else None,
            concurrency=int(fields["concurrency"]) if "concurrency" in fields else None,
            num_requests=int(fields["n"]) if "n" in fields else None,
            background=flag(fields.get("background", "0")),
            ignore_eos=flag(fields["ignore_eos"]) if "ignore_eos" in fields else ignore_eos,
        )


# A chat-like mix: most prompts short, a long tail; answers of a few hundred tokens at most.
PRESETS: dict[str, RequestClass] = {
    "chat": RequestClass("chat", LengthDist.parse("lognormal:160:0.9:40:1536"),
                         LengthDist.parse("lognormal:96:0.8:8:512"), ignore_eos=False),
}


# ---- requests ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: a prompt (text, token ids or chat messages) and its output bound."""

    request_class: str
    max_tokens: int
    ignore_eos: bool
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    input_tokens: int | None = None  # as built here; the server's usage is the final word

    def body(self, endpoint: str, model: str | None, temperature: float) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extension: only sent when asked for
        if endpoint == "chat":
            messages = self.messages
            if messages is None:
                text = self.prompt if isinstance(self.prompt, str) else None
                if text is None:
                    raise ValueError("a token-id prompt needs the completions endpoint")
                messages = [{"role": "user", "content": text}]
            body["messages"] = messages
        else:
            if self.prompt is None:
                raise ValueError("chat messages need the chat endpoint")
            body["prompt"] = self.prompt
        return body


class PromptFactory:
    """Synthetic prompts of an exact token count under a given tokenizer.

    Prompts are runs of random common words, each one token with its leading space (so every
    request's prompt differs and nothing is cached across requests). Chat prompts are counted
    after the chat template, so ``input=N`` means N prompt tokens on the server either way.
    """

    def __init__(self, tokenizer: Any, *, max_words: int = 4000) -> None:
        self.tokenizer = tokenizer
        words: list[tuple[int, str]] = []
        for token_id in sorted(tokenizer.get_vocab().values()):
            text = tokenizer.decode([token_id])
            if _WORD.fullmatch(text) and self._encode(text) == [token_id]:
                words.append((token_id, text))
                if len(words) >= max_words:
                    break
        if len(words) < 100:
            raise ValueError("this tokenizer has too few single-token words for synthetic "
                             "prompts; use a JSONL prompt file")
        self.word_ids = [w[0] for w in words]
        self.words = [w[1] for w in words]
        self._chat_overhead: int | None = None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self._encode(text)

    def token_ids(self, n: int, rng: random.Random) -> list[int]:
        """n token ids of random words (a /v1/completions prompt of exactly n tokens)."""
        return [rng.choice(self.word_ids) for _ in range(n)]

    def text(self, n: int, rng: random.Random) -> str:
        """A text of exactly n tokens (no special tokens added; it starts with a space)."""
        return "".join(rng.choice(self.words) for _ in range(n))

    @property
    def chat_overhead(self) -> int:
        """Tokens the chat template adds around one user message."""
        if self._chat_overhead is None:
            self._chat_overhead = len(self.encode_chat([{"role": "user", "content": ""}]))
        return self._chat_overhead

    def chat_messages(self, n: int, rng: random.Random) -> list[dict[str, str]]:
        """One user message whose templated prompt is exactly n tokens."""
        if n <= self.chat_overhead:
            raise ValueError(f"a chat prompt needs more than {self.chat_overhead} tokens "
                             f"(the template's own), got {n}")
        words = [rng.choice(self.words) for _ in range(n - self.chat_overhead)]
        for _ in range(8):  # the template's joins may merge or split a token: correct for it
            messages = [{"role": "user", "content": "".join(words).lstrip()}]
            diff = n - len(self.encode_chat(messages))
            if diff == 0:
                return messages
            if diff > 0:
                words.extend(rng.choice(self.words) for _ in range(diff))
            else:
                del words[diff:]
        raise ValueError(f"could not build a chat prompt of exactly {n} tokens")

    def make(self, request_class: RequestClass, endpoint: str,
             rng: random.Random) -> RequestSpec:
        assert request_class.input_len is not None
        n_in = request_class.input_len.sample(rng)
        n_out = request_class.output_len.sample(rng)
        common = dict(request_class=request_class.name, max_tokens=n_out,
                      ignore_eos=request_class.ignore_eos, input_tokens=n_in)
        if endpoint == "chat":
            return RequestSpec(messages=self.chat_messages(n_in, rng), **common)
        return RequestSpec(prompt=self.token_ids(n_in, rng), **common)


@dataclass(slots=True)
class PromptFile:
    """Prompts from a JSONL file: one object per line with ``prompt`` (text or token ids) or
    ``messages``, and optionally ``max_tokens`` and ``class``."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> PromptFile:
        entries = []
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
                raise ValueError(f"{path}:{lineno}: give exactly one of prompt or messages")
            entries.append(obj)
        if not entries:
            raise ValueError(f"{path}: no prompts")
        return cls(entries)

    def make(self, request_class: RequestClass, rng: random.Random) -> RequestSpec:
        obj = rng.choice(self.entries)
        max_tokens = int(obj.get("max_tokens") or request_class.output_len.sample(rng))
        return RequestSpec(request_class=str(obj.get("class", request_class.name)),
                           max_tokens=max_tokens, ignore_eos=request_class.ignore_eos,
                           prompt=obj.get("prompt"), messages=obj.get("messages"))


# ---- arrivals ----------------------------------------------------------------------------


def arrival_gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Gaps between arrivals of a gamma process with mean ``1/rate`` seconds.

    ``burstiness`` 1 is Poisson (exponential gaps); below 1 arrivals come in bursts, above 1
    they are more even (vLLM's ``--burstiness``).
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    theta = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, theta)


def pick_class(classes: Sequence[RequestClass], rng: random.Random) -> RequestClass:
    return rng.choices(list(classes), weights=[c.weight for c in classes])[0]
