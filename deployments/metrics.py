"""Per-phase metrics through ``ray.serve.metrics`` (exported on Ray's metrics endpoint).

Names and units follow vLLM where vLLM has the same quantity, so the dashboards written for
vLLM and for Ray Serve LLM read this app unchanged: Ray exports a metric declared here as
``vllm_time_to_first_token_seconds`` as ``ray_vllm_time_to_first_token_seconds``, which is
the name Ray Serve LLM gives vLLM's ``vllm:time_to_first_token_seconds`` (Ray refuses ``:``
in names and prefixes ``ray_``). What vLLM has no name for is ``splitserve_*``. Times are in
seconds, sizes in bytes, and every metric carries ``model_name`` (the served model name);
Serve adds ``application``, ``deployment`` and ``replica``. ``declared_names()`` lists them
all (the Grafana dashboard's test checks its queries against it).

Replicas also keep a few figures in memory (``stats()`` on each deployment) so tests, the
autoscaling policies and the load tests can read them without a Prometheus server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ray.serve.metrics import Counter, Gauge, Histogram

# vLLM's buckets for request latencies (s) and its token-count buckets
_SECONDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
_BYTES = [2**k for k in range(10, 34, 2)]

MODEL_LABEL = "model_name"


class _Metrics:
    """Declares metrics that all carry the ``model_name`` label set to ``model_name``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def _tagged(self, metric: Any) -> Any:
        metric.set_default_tags({MODEL_LABEL: self.model_name})  # Serve's returns None
        return metric

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._tagged(Counter(name, doc, tag_keys=(MODEL_LABEL, *labels)))

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._tagged(Gauge(name, doc, tag_keys=(MODEL_LABEL, *labels)))

    def histogram(self, name: str, doc: str, boundaries: list[float]) -> Histogram:
        return self._tagged(Histogram(name, doc, boundaries=boundaries,
                                      tag_keys=(MODEL_LABEL,)))

    def metrics(self) -> Iterator[Any]:
        return (v for v in vars(self).values() if isinstance(v, (Counter, Gauge, Histogram)))


class IngressMetrics(_Metrics):
    """What the ingress sees of each answer: latencies as the client sees them (less the
    network), token counts and outcomes. An ``n > 1`` request counts as ``n`` answers."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.ttft = self.histogram("vllm_time_to_first_token_seconds",
                                   "Time to first token (ingress view).", _SECONDS)
        self.itl = self.histogram("vllm_inter_token_latency_seconds",
                                  "Time between two output tokens at the ingress.", _SECONDS)
        self.tpot = self.histogram("vllm_request_time_per_output_token_seconds",
                                   "Mean time per output token after the first, per answer.",
                                   _SECONDS)
        self.e2e = self.histogram("vllm_e2e_request_latency_seconds",
                                  "Arrival to last token, per answer.", _SECONDS)
        self.prompt_tokens = self.counter("vllm_prompt_tokens_total",
                                          "Prompt tokens of finished answers.")
        self.generation_tokens = self.counter("vllm_generation_tokens_total",
                                              "Output tokens delivered.")
        self.request_prompt_tokens = self.histogram("vllm_request_prompt_tokens",
                                                    "Prompt tokens per answer.", _TOKENS)
        self.request_generation_tokens = self.histogram(
            "vllm_request_generation_tokens", "Output tokens per answer.", _TOKENS)
        self.success = self.counter("vllm_request_success_total", "Answers that ended "
                                    "normally, by finished_reason (stop, length, abort: the "
                                    "client left).", ("finished_reason",))
        self.requests = self.counter("splitserve_requests_total", "Answers and refused "
                                     "requests by outcome: ok, cancelled or the error's type.",
                                     ("route", "outcome"))
        self.in_flight = self.gauge("splitserve_ingress_in_flight", "Answers in the ingress.")


class PrefillMetrics(_Metrics):
    """A prefill queue's load, its passes and the prefix cache. ``count_waiting`` False: a
    colocated replica, whose decode side reports the waiting requests of both."""

    def __init__(self, model_name: str, count_waiting: bool = True) -> None:
        super().__init__(model_name)
        self.batch_size = self.histogram("splitserve_prefill_batch_size", "Prompts per "
                                         "prefill pass.", [1, 2, 4, 8, 16, 32, 64])
        self.batch_tokens = self.histogram("splitserve_prefill_batch_tokens", "Prompt tokens "
                                           "computed per prefill pass.", _TOKENS)
        self.compute = self.histogram("splitserve_prefill_compute_seconds", "Prefill pass "
                                      "time.", _SECONDS)
        self.kv_bytes = self.histogram("splitserve_kv_package_bytes", "KV package size.",
                                       _BYTES)
        self.waiting_tokens = self.gauge("splitserve_prefill_waiting_tokens", "Prompt tokens "
                                         "queued or being computed in this replica.")
        self.waiting_requests = self.gauge(
            "vllm_num_requests_waiting", "Prompts queued or being prefilled in this replica "
            "(decode: sequences waiting for a batch row).") if count_waiting else None
        self.cache_queried = self.counter("vllm_prefix_cache_queries_total",
                                          "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = self.counter("vllm_prefix_cache_hits_total",
                                       "Prompt tokens whose KV came from the prefix cache.")
        self.cache_evictions = self.counter("splitserve_prefix_cache_evictions_total",
                                            "Prefix cache blocks evicted.")
        self.cache_bytes = self.gauge("splitserve_prefix_cache_bytes", "Bytes of KV in the "
                                      "prefix cache.")
        self._seen = (0, 0, 0)

    def record_waiting(self, tokens: int, requests: int) -> None:
        self.waiting_tokens.set(tokens)
        if self.waiting_requests is not None:
            self.waiting_requests.set(requests)

    def record_prefix_cache(self, cache) -> None:
        """Bring the counters up to ``cache``'s totals (an ``app.prefix_cache.PrefixCache``)."""
        now = (cache.queried_tokens, cache.hit_tokens, cache.evictions)
        for counter, new, old in zip((self.cache_queried, self.cache_hits,
                                      self.cache_evictions), now, self._seen, strict=True):
            if new > old:
                counter.inc(new - old)
        self._seen = now
        self.cache_bytes.set(cache.bytes)


class DecodeMetrics(_Metrics):
    """A decode replica's batch, KV pool and steps, and the KV hops that reach it."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.kv_hop = self.histogram("splitserve_kv_hop_seconds", "From prefill's return to "
                                     "the decode replica holding the KV package.", _SECONDS)
        self.kv_hop_bytes = self.counter("splitserve_kv_hop_bytes_total", "KV package bytes "
                                         "received from prefill replicas.")
        self.step = self.histogram("splitserve_decode_step_seconds", "Decode step time.",
                                   _SECONDS)
        self.running = self.gauge("vllm_num_requests_running", "Sequences in the decode "
                                  "batch.")
        self.waiting = self.gauge("vllm_num_requests_waiting", "Sequences waiting for a "
                                  "batch row (prefill: prompts queued or being prefilled).")
        self.kv_usage = self.gauge("vllm_kv_cache_usage_perc", "Fraction of the KV pool held "
                                   "by running sequences (0 to 1).")
        self.kv_tokens = self.gauge("splitserve_decode_kv_tokens", "KV tokens held by running "
                                    "sequences.")


class KernelMetrics(_Metrics):
    """Which path each of a replica's engine parts runs (app.model_runner.kernel_paths): 1 for
    the path in force, so a dashboard shows a replica that fell back to the slow one."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.path = self.gauge("splitserve_kernel_path", "1 for the path each engine part "
                               "runs: kind (linear, decode_attention, prefill_attention, "
                               "decode_step, pass_layers) and path (e.g. kernel, torch, "
                               "fused, modules).",
                               ("kind", "path"))

    def record(self, paths: dict[str, str]) -> None:
        for kind, path in paths.items():
            self.path.set(1, tags={"kind": kind, "path": path})


def declared_names() -> set[str]:
    """Every metric name this app declares, as declared (Ray exports it with ``ray_``)."""
    names: set[str] = set()
    for cls in (IngressMetrics, PrefillMetrics, DecodeMetrics, KernelMetrics):
        names.update(m.info["name"] for m in cls("x").metrics())
    return names
