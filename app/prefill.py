"""Prefill: batch prompts under a token budget, sample each first token, emit KV packages."""

from __future__ import annotations

import time
from collections.abc import Iterator

from app.kv_package import KVPackage
from app.messages import PrefillRequest
from app.model_runner import ModelRunner
from app.sampling import sample_tokens
from app.sequence import validate_prompt


def plan_batches(
    requests: list[PrefillRequest], token_budget: int, max_batch_size: int
) -> Iterator[list[PrefillRequest]]:
    """Group requests so each padded batch (rows x longest prompt) fits the token budget.

    Requests are sorted by length so neighbours pad little; a prompt longer than the budget
    runs alone.
    """
    batch: list[PrefillRequest] = []
    longest = 0
    for req in sorted(requests, key=lambda r: r.num_tokens):
        n = req.num_tokens
        if batch and (
            (len(batch) + 1) * max(longest, n) > token_budget or len(batch) >= max_batch_size
        ):
            yield batch
            batch, longest = [], 0
        batch.append(req)
        longest = max(longest, n)
    if batch:
        yield batch


class Prefiller:
    """Turns prompts into KV packages. Stateless between calls; thread-compatible."""

    def __init__(self, runner: ModelRunner, fingerprint: str) -> None:
        self.runner = runner
        self.fingerprint = fingerprint

    def validate(self, req: PrefillRequest) -> None:
        validate_prompt(
            req.prompt_token_ids,
            req.sampling,
            max_model_len=self.runner.max_model_len,
            vocab_size=self.runner.vocab_size,
        )

    def make_packages(self, requests: list[PrefillRequest]) -> list[KVPackage]:
        """One KV package per request, in the order given. Raises on an invalid request
        before any compute, so a bad prompt never costs the others a forward pass."""
        for req in requests:
            self.validate(req)
            assert req.sampling.seed is not None or req.sampling.greedy, "seed set at admission"
        cfg = self.runner.config
        by_id: dict[str, KVPackage] = {}
        for batch in plan_batches(requests, cfg.prefill_token_budget, cfg.prefill_max_batch_size):
            for pkg in self._package_batch(batch):
                by_id[pkg.request_id] = pkg
        return [by_id[r.request_id] for r in requests]

    def _package_batch(self, batch: list[PrefillRequest]) -> list[KVPackage]:
        start = time.perf_counter()
        prompts = [list(r.prompt_token_ids) for r in batch]
        logits, kvs = self.runner.forward_prefill(prompts)  # [B, V], per request [L, 2, kvh, n, hd]
        firsts = sample_tokens(
            logits, [r.sampling for r in batch], [r.output_offset for r in batch],
            history=prompts
        )
        elapsed = time.perf_counter() - start
        now = time.time()
        return [
            KVPackage.from_tensor(
                request_id=r.request_id,
                fingerprint=self.fingerprint,
                kv=kv,
                prompt_token_ids=prompt,
                first_token=first,
                sampling=r.sampling,
                vocab_size=self.runner.vocab_size,
                created_at=now,
                prefill_s=elapsed,
                output_offset=r.output_offset,
            )
            for r, kv, prompt, first in zip(batch, kvs, prompts, firsts, strict=True)
        ]
