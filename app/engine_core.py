"""Prefill and decode in one process over the same code: the reference path and the engine of
the colocated baseline."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from app.chat import PromptBuilder
from app.config import EngineConfig
from app.decode import Decoder
from app.decode_loop import DecodeLoop
from app.fingerprint import fingerprint
from app.kv_package import KVPackage
from app.messages import PrefillRequest
from app.model_loader import load_model, load_tokenizer
from app.model_runner import ModelRunner
from app.output import GenerationOutput, StreamDelta, text_deltas
from app.prefill import Prefiller
from app.prefix_cache import PrefixCache
from app.sampling import SamplingParams
from app.structured import Grammars

logger = logging.getLogger(__name__)
T = TypeVar("T")


def apply_thread_setting(num_threads: int | None) -> None:
    """Bound torch's intra-op threads (a one-core replica must not spawn one per core)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)


LANE_NICE = 19  # an extra lane's thread: the lowest CPU priority


def thread_nice() -> int | None:
    """The calling thread's nice, or None where the OS has no per-thread priority."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return None


def set_thread_nice(nice: int | None) -> None:
    """Give the calling thread (and the threads it starts from now on) CPU priority ``nice``
    (None: leave it). Raising one's niceness needs no privilege; lowering it below the
    process's needs CAP_SYS_NICE (or RLIMIT_NICE), and where the OS refuses, the thread keeps
    its priority and the log says why."""
    if nice is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except PermissionError:
        logger.warning("thread %s: nice %d refused by the OS (below the process's needs "
                       "CAP_SYS_NICE or RLIMIT_NICE); it keeps nice %s",
                       threading.current_thread().name, nice, thread_nice())
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        pass


def _extra_lane_init() -> None:
    """An extra lane's thread: one torch thread (no OpenMP team of its own), and the
    lowest CPU priority, so its pass takes the cycles others leave."""
    torch.set_num_threads(1)
    set_thread_nice(LANE_NICE)


class EngineCore:
    """Model, runner and fingerprint: what both phases load.

    One thread of its own (``thread``) loads the model and runs every forward pass, and
    ``run`` is how async code reaches it. A prefill replica with ``prefill_lanes`` > 1 also
    runs passes on extra lanes (``run(..., lane=i)``), each a thread of its own on one torch
    thread at the lowest CPU priority. Torch's OpenMP pool belongs to the thread that
    calls it: once two threads of a process have run parallel ops, there are more pool
    threads than cores and every parallel region wakes its workers the slow way (what that
    cost a decode step: BENCHMARKS.md, "Split vs colocated").
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        apply_thread_setting(config.num_threads)
        self.config = config
        # the engine thread's priority is set before it loads the model, so that the OpenMP
        # workers it starts inherit it
        self.thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine",
            initializer=functools.partial(set_thread_nice, config.nice))
        self._lanes = [self.thread]
        # the engine thread's nice as the OS left it (EngineConfig.nice; None: not Linux)
        self.nice = self.thread.submit(thread_nice).result()
        if model is None:
            self.model = self.thread.submit(load_model, config).result()
            self.fingerprint = self.thread.submit(
                lambda: fingerprint(self.model).as_str()).result()
            # the weights' packing too: its parallel ops on this constructor's thread would
            # start a second OpenMP team (see above; served, BENCHMARKS.md §7, "Settings
            # behind the serve configs")
            self.runner = self.thread.submit(ModelRunner, self.model, config).result()
        else:
            # the caller's model, built on the caller's thread (benchmarks and tests that
            # drive the runner directly): keep this constructor's torch work there too
            self.model = model
            self.fingerprint = fingerprint(model).as_str()
            self.runner = ModelRunner(self.model, config)
        # structured outputs: the tokenizer is loaded on the first constrained answer
        self.grammars = Grammars(functools.partial(load_tokenizer, config))

    @classmethod
    def here(cls, config: EngineConfig) -> EngineCore:
        """An engine whose model is loaded and packed on the calling thread, for benchmarks
        that run passes from that thread: the process then has one OpenMP team, as a replica
        has. (Passes on this thread of an engine loaded on its own would start a second
        team, and libgomp then sleeps the workers at every barrier: a 2-thread decode step
        ran up to 1.3x slower.)"""
        return cls(config, model=load_model(config))

    def lane(self, index: int) -> ThreadPoolExecutor:
        """Engine thread ``index``: 0 is ``thread``, the others are made on first use."""
        while len(self._lanes) <= index:
            self._lanes.append(ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"engine-lane{len(self._lanes)}",
                initializer=_extra_lane_init))
        return self._lanes[index]

    async def run(self, fn: Callable[..., T], *args: Any, lane: int = 0) -> T:
        """``fn(*args)`` on the engine's thread (or on extra lane ``lane``)."""
        return await asyncio.get_running_loop().run_in_executor(self.lane(lane), fn, *args)

    def make_prefiller(self, eos_token_ids: frozenset[int] = frozenset()) -> Prefiller:
        """A prefiller with its own prefix cache (``prefix_cache_mb``; none when 0).
        ``eos_token_ids``: the decoder's, masked from a first token under ``min_tokens``."""
        mb = self.config.prefix_cache_mb
        cache = PrefixCache(self.fingerprint, mb << 20) if mb > 0 else None
        return Prefiller(self.runner, self.fingerprint, cache, eos_token_ids, self.grammars)

    def make_decode_loop(self, eos_token_ids: frozenset[int]) -> DecodeLoop:
        decoder = Decoder(
            self.runner,
            eos_token_ids=eos_token_ids,
            max_batch_size=self.config.max_batch_size,
            max_kv_tokens=self.config.max_kv_tokens,
            grammars=self.grammars,
            step_threads=self.config.decode_threads,
        )
        return DecodeLoop(decoder, max_waiting=self.config.max_waiting,
                          fingerprint=self.fingerprint, executor=self.thread)


class LocalEngine:
    """Tokenize, prefill, decode and detokenize in one process."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any | None = None,
        eos_token_ids: frozenset[int] | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.core = EngineCore(self.config, model)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.config)
        self.prompts = PromptBuilder(self.tokenizer)
        if eos_token_ids is None:
            eos_token_ids = self.prompts.eos_token_ids(
                getattr(self.core.model, "generation_config", None)
            )
        self.eos_token_ids = eos_token_ids
        self.prefiller = self.core.make_prefiller(eos_token_ids)
        self.decode_loop = self.core.make_decode_loop(eos_token_ids)

    @property
    def max_model_len(self) -> int:
        return self.core.runner.max_model_len

    def make_request(
        self,
        sampling: SamplingParams,
        *,
        prompt: str | list[int] | None = None,
        messages: Seq[dict[str, Any]] | None = None,
        request_id: str | None = None,
    ) -> PrefillRequest:
        """Tokenize and validate; raises a typed 400-class error on bad input."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        ids = (self.prompts.encode_chat(messages) if messages is not None
               else self.prompts.encode_prompt(prompt))  # type: ignore[arg-type]
        req = PrefillRequest(request_id or uuid.uuid4().hex, tuple(ids), sampling.with_seed())
        self.prefiller.validate(req)
        return req

    async def prefill_package(self, req: PrefillRequest) -> KVPackage:
        [package] = await self.core.run(self.prefiller.make_packages, [req])
        return package

    async def stream(self, req: PrefillRequest) -> AsyncIterator[StreamDelta]:
        package = await self.prefill_package(req)
        async for delta in text_deltas(self.decode_loop.generate(package), self.tokenizer,
                                       req.sampling):
            yield delta

    async def generate(self, req: PrefillRequest) -> GenerationOutput:
        out = GenerationOutput(req.request_id, list(req.prompt_token_ids))
        async for delta in self.stream(req):
            out.text += delta.text
            out.token_ids.extend(delta.token_ids)
            out.finish_reason = delta.finish_reason or out.finish_reason
        return out

    async def close(self) -> None:
        await self.decode_loop.close()
