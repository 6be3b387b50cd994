"""Per-phase metrics through ``ray.serve.metrics`` (exported on Ray's metrics endpoint).

Replicas also keep a few figures in memory (``stats()`` on each deployment) so tests, the
autoscaling policies and the load tests can read them without a Prometheus server.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

_MS = [1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 2000, 5000, 10000]
_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
_BYTES = [2**k for k in range(10, 34, 2)]


class IngressMetrics:
    def __init__(self) -> None:
        self.ttft_ms = Histogram("splitserve_ttft_ms", "Time to first token (ingress view).",
                                 boundaries=_MS)
        self.tpot_ms = Histogram("splitserve_tpot_ms", "Mean time per output token after the "
                                 "first, per request.", boundaries=_MS)
        self.requests = Counter("splitserve_requests_total", "Requests by outcome.",
                                tag_keys=("route", "outcome"))
        self.in_flight = Gauge("splitserve_ingress_in_flight", "Requests in the ingress.")


class PrefillMetrics:
    def __init__(self) -> None:
        self.batch_size = Histogram("splitserve_prefill_batch_size", "Prompts per prefill "
                                    "call.", boundaries=[1, 2, 4, 8, 16, 32])
        self.batch_tokens = Histogram("splitserve_prefill_batch_tokens", "Prompt tokens per "
                                      "prefill call.", boundaries=_TOKENS)
        self.compute_ms = Histogram("splitserve_prefill_compute_ms", "Prefill compute per call.",
                                    boundaries=_MS)
        self.kv_bytes = Histogram("splitserve_kv_package_bytes", "KV package size.",
                                  boundaries=_BYTES)
        self.waiting_tokens = Gauge("splitserve_prefill_waiting_tokens", "Prompt tokens queued "
                                    "or running in this replica.")
        self.waiting_requests = Gauge("splitserve_prefill_waiting_requests", "Prompts queued or "
                                      "running in this replica.")
        self.cache_queried = Counter("splitserve_prefix_cache_queried_tokens_total",
                                     "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = Counter("splitserve_prefix_cache_hit_tokens_total",
                                  "Prompt tokens whose KV came from the prefix cache.")
        self.cache_evictions = Counter("splitserve_prefix_cache_evictions_total",
                                       "Prefix cache blocks evicted.")
        self.cache_bytes = Gauge("splitserve_prefix_cache_bytes", "Bytes of KV in the prefix "
                                 "cache.")
        self._seen = (0, 0, 0)

    def record_prefix_cache(self, cache) -> None:
        """Bring the counters up to ``cache``'s totals (an ``app.prefix_cache.PrefixCache``)."""
        now = (cache.queried_tokens, cache.hit_tokens, cache.evictions)
        for counter, new, old in zip((self.cache_queried, self.cache_hits,
                                      self.cache_evictions), now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now
        self.cache_bytes.set(cache.bytes)


class DecodeMetrics:
    def __init__(self) -> None:
        self.kv_hop_ms = Histogram("splitserve_kv_hop_ms", "From prefill return to decode "
                                   "holding the KV package.", boundaries=_MS)
        self.step_ms = Histogram("splitserve_decode_step_ms", "Decode step time.",
                                 boundaries=_MS)
        self.active = Gauge("splitserve_decode_active_sequences", "Sequences streaming.")
        self.waiting = Gauge("splitserve_decode_waiting_sequences", "Sequences waiting for a "
                             "batch row.")
        self.kv_tokens = Gauge("splitserve_decode_kv_tokens", "KV tokens held by running "
                               "sequences.")
