"""Prefill: prompts in chunks under a token budget, a cached prefix reused, KV packages out.

A prompt becomes a :class:`PrefillJob`. Its start may come from the prefix cache
(``app.prefix_cache``); the rest is computed in passes of at most ``prefill_chunk_tokens``
tokens per prompt, each pass attending to what earlier passes computed. A prompt is done
(its first token sampled, its KV package made, its blocks cached) when its last chunk is.

Which prompts share a pass, and which chunks ride in a decode step, is
``app.prefill_policy.PrefillPolicy``'s to say (shortest remaining first, fairness, the
chunk, batch and padding bounds; its docstring). Preemption between layers: a server runs
a pass ``prefill_preempt_layers`` layers at a time (``start_pass``, ``advance``), and a
prompt that arrived meanwhile needing at most half the pass's tokens gets a pass of its own
before the rest (``app.prefill_queue.PrefillQueue``): a chat waits for a few layers of a
document's chunk, not the whole chunk.

Threads: a pass runs on the engine's ``num_threads``, or, with ``prefill_max_threads``, on as
many more as the rest of the machine leaves cores idle (``app.idle_cores``: where the phases
share one machine, the decode replica's core while no stream runs). With ``prefill_lanes``,
a prefill replica runs several passes at once instead, each on a thread of its own
(``app.prefill_queue.PrefillQueue``, ``advance(..., alone=False)``).

``make_packages`` runs a list of prompts to completion (tests, benchmarks, the local
engine); a server drives ``new_job`` / ``plan_pass`` / ``run_pass`` itself so that prompts
arriving between passes join the queue (``app.prefill_queue.PrefillQueue``).

Mixed batching (``mixed_batch``, the colocated engine): while sequences are decoding,
``plan_chunks`` picks the chunks that ride along in the next decode step
(``Decoder.step``, ``ModelRunner.forward_mixed``) instead of a pass of their own, the pass's
tokens decode rows included within the same budget, and ``complete`` finishes them exactly as
``run_pass`` does.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from app.idle_cores import IdleCores
from app.kv_cache import SpareBuffers
from app.kv_package import KVPackage
from app.messages import PrefillRequest
from app.model_runner import ModelRunner
from app.prefill_policy import PrefillPolicy
from app.prefix_cache import PrefixCache
from app.sampling import SamplingParams, TokenLogprobs, sample_tokens, token_logprobs
from app.sequence import validate_prompt
from app.structured import GrammarMatcher, Grammars


@dataclass(eq=False)
class PrefillJob:
    """One prompt on its way through prefill."""

    req: PrefillRequest
    arrived: float = field(default_factory=time.monotonic)
    done: int = 0  # prompt positions whose KV exists (cached prefix + computed chunks)
    cached: int = 0  # of those, taken from the prefix cache
    # KV along positions not yet in ``whole``, in order (a cached prefix's blocks, each
    # pass's chunk)
    parts: list[torch.Tensor] = field(default_factory=list)
    # once the prompt's KV is in two parts, or a pass writes its chunk straight in (a pass of
    # this prompt alone, Prefiller.start_pass): ``[layers, 2, kv_heads, num_tokens,
    # head_dim]``, its first ``in_whole`` positions filled, each part copied in once (not
    # every pass)
    whole: torch.Tensor | None = None
    in_whole: int = 0
    compute_s: float = 0.0
    passes: int = 0
    cancelled: bool = False

    @property
    def remaining(self) -> int:
        return self.req.num_tokens - self.done

    def kv(self, dtype: torch.dtype | None = None, room: bool = False) -> torch.Tensor | None:
        """KV of positions ``0..done-1`` ``[layers, 2, kv_heads, done, head_dim]``: a view
        of ``whole`` once there were two parts or ``room`` for the next chunks was asked
        for (``whole`` is made then, in ``dtype``: default the parts'; each part is cast as
        it is copied in); the whole tensor once the prompt is done."""
        if self.whole is None:
            if not self.parts or (len(self.parts) == 1 and not room):
                return self.parts[0] if self.parts else None
            shape = list(self.parts[0].shape)
            shape[3] = self.req.num_tokens
            self.whole = self.parts[0].new_empty(shape, dtype=dtype or self.parts[0].dtype)
        for part in self.parts:
            n = part.shape[3]
            self.whole[:, :, :, self.in_whole : self.in_whole + n] = part
            self.in_whole += n
        self.parts = []
        return self.whole[:, :, :, : self.in_whole]


@dataclass(eq=False)
class ChunkPlan:
    """The prompt part of a mixed pass (``Prefiller.plan_chunks``): the next ``sizes[i]``
    tokens of each job in ``rows``. The decode step that runs it (``Decoder.step``) reads
    its ``inputs`` and hands back the pass's chunk logits and KV (``complete``), after
    which ``packages`` holds one package per row whose prompt the pass finished."""

    prefiller: Prefiller
    rows: list[PrefillJob]
    sizes: list[int]
    packages: list[KVPackage | None] = field(default_factory=list)
    before: list[int] = field(default_factory=list)  # each row's remaining tokens, planned
    elapsed: float = 0.0  # seconds of the pass that computed it
    # per row: its chunk is written straight into its KV so far (``inputs``' ``into``)
    in_place: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.before = [j.remaining for j in self.rows]

    @property
    def tokens(self) -> int:
        return sum(self.sizes)

    def inputs(self) -> tuple[list[list[int]], list[torch.Tensor | None],
                              list[torch.Tensor | None]]:
        """Each row's chunk (token ids), the KV of its positions before it (or None) and,
        for a prompt's later chunk (where the runner holds a prompt's KV so far in its own
        dtype: ``Prefiller.work_dtype``), that KV with room for the rest, which the pass
        writes the chunk into (``ModelRunner.forward_mixed``'s ``into``), else None."""
        chunks = [list(j.req.prompt_token_ids[j.done : j.done + n])
                  for j, n in zip(self.rows, self.sizes, strict=True)]
        self.in_place = [self.prefiller.room(j, n) for j, n in zip(self.rows, self.sizes,
                                                                   strict=True)]
        work = self.prefiller.work_dtype
        past = [j.kv(work, room=room) for j, room in zip(self.rows, self.in_place, strict=True)]
        into = [j.whole if room else None
                for j, room in zip(self.rows, self.in_place, strict=True)]
        return chunks, past, into

    def complete(self, logits: torch.Tensor, kvs: list[torch.Tensor], start: float) -> None:
        self.packages = self.prefiller.complete(self.rows, self.sizes, logits, kvs, start,
                                                self.in_place)
        self.elapsed = time.perf_counter() - start


@dataclass
class PassInProgress:
    """A prefill pass that runs a few layers at a time (``Prefiller.start_pass``,
    ``Prefiller.advance``)."""

    rows: list[PrefillJob]
    sizes: list[int]  # tokens each row computes in this pass
    steps: Generator[int, None, tuple[torch.Tensor, list[torch.Tensor]]]
    tokens: int  # rows' chunk tokens in all
    in_place: bool = False  # the pass writes its one row's chunk into the job's ``whole``
    layers_done: int = 0
    busy_s: float = 0.0  # time spent running it (not paused)


class Prefiller:
    """Turns prompts into KV packages. Thread-compatible: plan on one thread, run passes on
    the engine's; the prefix cache is thread-safe."""

    def __init__(self, runner: ModelRunner, fingerprint: str,
                 prefix_cache: PrefixCache | None = None,
                 eos_token_ids: frozenset[int] = frozenset(),
                 grammars: Grammars | None = None) -> None:
        self.runner = runner
        self.grammars = grammars  # constrained first tokens (app.structured)
        self.fingerprint = fingerprint
        self.prefix_cache = prefix_cache
        self.eos_token_ids = eos_token_ids  # masked from a first token under min_tokens
        self.spares = SpareBuffers()  # chunked prompts' KV so far, reused (``room``)
        cfg = runner.config
        # which prompts and chunks each pass takes: the policy the planner's simulator runs
        self.policy = PrefillPolicy.from_config(cfg)
        # more threads for a pass while the machine's other cores are idle (app.idle_cores)
        base = cfg.num_threads or torch.get_num_threads()
        self.idle_cores = (IdleCores(base, max(base, cfg.prefill_max_threads))
                           if cfg.prefill_max_threads else None)

    @property
    def work_dtype(self) -> torch.dtype | None:
        """The dtype a chunked prompt's KV so far is held in (``PrefillJob.whole``): the
        runner's, so that its next pass writes its chunk in place; None where it cannot."""
        r = self.runner
        return r.dtype if r.room_for_chunks(r.dtype, r.kv_device) else None

    def room(self, job: PrefillJob, n: int) -> bool:
        """Whether ``job``'s next ``n`` tokens go straight into its KV so far (``whole``, in
        ``work_dtype``; made now for a prompt's first of several chunks), not for a prompt
        that is this one chunk."""
        work = self.work_dtype
        if work is None or (job.done == 0 and job.remaining <= n):
            return False
        if job.whole is None and not job.parts:
            lay = self.runner.layout
            job.whole = self.spares.take((lay.num_layers, 2, lay.num_kv_heads,
                                          job.req.num_tokens, lay.head_dim), work,
                                         self.runner.kv_device)
        return True

    def validate(self, req: PrefillRequest) -> None:
        validate_prompt(
            req.prompt_token_ids,
            req.sampling,
            max_model_len=self.runner.max_model_len,
            vocab_size=self.runner.vocab_size,
        )

    def new_job(self, req: PrefillRequest) -> PrefillJob:
        """Validate ``req`` and start its job from its cached prefix, if any."""
        self.validate(req)
        assert req.sampling.seed is not None or req.sampling.greedy, "seed set at admission"
        job = PrefillJob(req)
        if self.prefix_cache is not None:
            match = self.prefix_cache.match(req.prompt_token_ids)
            job.parts, job.done, job.cached = list(match.blocks), match.tokens, match.tokens
        return job

    def make_packages(self, requests: list[PrefillRequest]) -> list[KVPackage]:
        """One KV package per request, in the order given. Raises on an invalid request
        before any compute, so a bad prompt never costs the others a forward pass."""
        jobs = [self.new_job(r) for r in requests]
        by_job: dict[int, KVPackage] = {}
        while len(by_job) < len(jobs):
            rows = self.plan_pass([j for j in jobs if id(j) not in by_job])
            for job, pkg in zip(rows, self.run_pass(rows), strict=True):
                if pkg is not None:
                    by_job[id(job)] = pkg
        return [by_job[id(j)] for j in jobs]

    # ---- scheduling ------------------------------------------------------------------

    def chunk_of(self, job: PrefillJob) -> int:
        return self.policy.chunk_of(job)

    def _head_and_order(self, jobs: list[PrefillJob], now: float | None
                        ) -> tuple[PrefillJob | None, list[PrefillJob]]:
        """The job that leads the next plan (``PrefillPolicy.head``) and the live jobs
        shortest remaining first, as the policy takes them."""
        live = [j for j in jobs if not j.cancelled and j.remaining > 0]
        if not live:
            return None, []
        now = time.monotonic() if now is None else now
        by_remaining = sorted(live, key=lambda j: (j.remaining, j.arrived))
        oldest = min(live, key=lambda j: j.arrived)
        return self.policy.head(oldest, by_remaining[0], now), by_remaining

    def plan_pass(self, jobs: list[PrefillJob], now: float | None = None) -> list[PrefillJob]:
        """The jobs that share the next pass (each computes its next chunk); [] if none
        (``PrefillPolicy.plan_pass``: the head, then shortest remaining first while they
        fit)."""
        head, order = self._head_and_order(jobs, now)
        return [] if head is None else self.policy.plan_pass(head, order)

    def plan_chunks(self, jobs: list[PrefillJob], decode_rows: int,
                    now: float | None = None) -> ChunkPlan | None:
        """The prompt chunks that join a decode step of ``decode_rows`` rows in one mixed
        pass (``ModelRunner.forward_mixed``; ``PrefillPolicy.plan_chunks`` says which); None
        if no job has tokens left."""
        head, order = self._head_and_order(jobs, now)
        if head is None:
            return None
        rows, sizes = self.policy.plan_chunks(head, order, decode_rows)
        return ChunkPlan(self, rows, sizes)

    # ---- compute ---------------------------------------------------------------------

    def run_pass(self, rows: list[PrefillJob]) -> list[KVPackage | None]:
        """Compute each row's next chunk in one forward pass; a package for each row whose
        prompt this finished, None for the others."""
        packages = self.advance(self.start_pass(rows))
        assert packages is not None
        return packages

    def start_pass(self, rows: list[PrefillJob]) -> PassInProgress:
        """A pass over each row's next chunk, not yet run (:meth:`advance` runs it)."""
        chunks = [list(j.req.prompt_token_ids[j.done : j.done + self.chunk_of(j)])
                  for j in rows]
        # a prompt's chunks, alone in their pass: written straight into its KV so far
        in_place = len(rows) == 1 and self.room(rows[0], len(chunks[0]))
        past = [j.kv(self.work_dtype, room=in_place) for j in rows]
        steps = self.runner.prefill_layers(
            chunks, past if any(p is not None for p in past) else None,
            rows[0].whole if in_place else None)
        return PassInProgress(rows, [len(c) for c in chunks], steps,
                              sum(len(c) for c in chunks), in_place)

    def advance(self, run: PassInProgress, layers: int | None = None, *,
                alone: bool = True) -> list[KVPackage | None] | None:
        """Run ``layers`` more of the pass's layers (None: the rest), under the runner's lock
        and on the pass's threads; once it has run its last, the rows advance as in
        :meth:`run_pass` and their packages are returned, else None. Between two calls
        another pass may run (a short prompt that should not wait for this one).

        ``alone=False``: other passes run at the same time, each on a thread of its own
        (a prefill replica's lanes): no runner lock (a pass shares nothing with another
        but the model's weights) and no idle cores taken (their threads are busy)."""
        began = time.perf_counter()
        target = None if layers is None else run.layers_done + layers
        with (self.idle_cores.pass_threads() if self.idle_cores and alone else nullcontext()), \
                (self.runner.lock if alone else nullcontext()):
            while target is None or run.layers_done < target:
                try:
                    run.layers_done = next(run.steps)
                except StopIteration as finished:
                    logits, kvs = finished.value
                    run.busy_s += time.perf_counter() - began
                    # the pass's own compute time, not the passes that ran while it paused
                    return self.complete(run.rows, run.sizes, logits, kvs,
                                         time.perf_counter() - run.busy_s, run.in_place)
        run.busy_s += time.perf_counter() - began
        return None

    def complete(self, rows: list[PrefillJob], sizes: list[int], logits: torch.Tensor,
                 kvs: list[torch.Tensor], start: float,
                 in_place: bool | list[bool] = False) -> list[KVPackage | None]:
        """After a pass computed ``sizes[i]`` more tokens of each row (``logits`` at each
        chunk's last token, ``kvs`` each chunk's KV, ``in_place``: already in the row's
        ``whole``, for every row or per row; ``start``: the pass's ``perf_counter``): the
        rows advance, and each row whose prompt this finished gets its first token(s) and
        its package (None for the others)."""
        flags = in_place if isinstance(in_place, list) else [in_place] * len(rows)
        for job, n, kv, placed in zip(rows, sizes, kvs, flags, strict=True):
            assert kv.shape[3] == n
            if placed:
                job.in_whole += n
            else:
                job.parts.append(kv)
            job.done += n
            job.passes += 1
        finished = [i for i, j in enumerate(rows) if j.remaining == 0]
        # one draw per answer (n > 1: answer k with its own seed) from the row's last logits
        draws = [(i, k) for i in finished for k in range(rows[i].req.n)]
        firsts: dict[int, list[tuple[int, TokenLogprobs | None]]] = {}
        if draws:
            last = logits[[i for i, _ in draws]]
            params = [rows[i].req.sampling.for_choice(k) for i, k in draws]
            tokens = sample_tokens(
                last, params, [rows[i].req.output_offset for i, _ in draws],
                history=[list(rows[i].req.prompt_token_ids) for i, _ in draws],
                outputs=[list(rows[i].req.delivered_token_ids) for i, _ in draws],
                eos_token_ids=self.eos_token_ids,
                matchers=self._matchers(params, [rows[i].req for i, _ in draws]),
            )
            for (i, _), token, lp in zip(draws, tokens, token_logprobs(last, params, tokens),
                                         strict=True):
                firsts.setdefault(i, []).append((token, lp))
        elapsed = time.perf_counter() - start
        for job in rows:
            job.compute_s += elapsed
        out: list[KVPackage | None] = [None] * len(rows)
        for i in finished:
            out[i] = self._package(rows[i], firsts[i])
        return out

    def _matchers(self, params: list[SamplingParams], reqs: list[PrefillRequest]
                  ) -> list[GrammarMatcher | None] | None:
        """Each constrained draw's matcher, past the tokens its stream already delivered
        (a resume); None when no draw has a constraint."""
        if all(p.constraint is None for p in params):
            return None
        assert self.grammars is not None, "a constrained request needs the engine's grammars"
        return [None if p.constraint is None else
                self.grammars.matcher(p.constraint, r.delivered_token_ids, self.eos_token_ids)
                for p, r in zip(params, reqs, strict=True)]

    def _package(self, job: PrefillJob,
                 firsts: list[tuple[int, TokenLogprobs | None]]) -> KVPackage:
        kv = job.kv()
        assert kv is not None and kv.shape[3] == job.req.num_tokens
        kv = kv.to(self.runner.kv_dtype)  # a ``whole`` in the runner's dtype: cast once
        if job.whole is not None and kv.dtype != job.whole.dtype:  # the cast is the package
            self.spares.give(job.whole)
            job.whole = None
        if self.prefix_cache is not None:
            self.prefix_cache.insert(job.req.prompt_token_ids, kv)
        r = job.req
        return KVPackage.from_tensor(
            request_id=r.request_id,
            fingerprint=self.fingerprint,
            kv=kv,
            prompt_token_ids=list(r.prompt_token_ids),
            first_token=firsts[0][0],
            first_logprobs=firsts[0][1],
            sampling=r.sampling,
            vocab_size=self.runner.vocab_size,
            created_at=time.time(),
            prefill_s=job.compute_s,
            output_offset=r.output_offset,
            cached_tokens=job.cached,
            choice_first_tokens=tuple(t for t, _ in firsts) if r.n > 1 else (),
            choice_first_logprobs=tuple(lp for _, lp in firsts) if r.n > 1 else (),
        )
