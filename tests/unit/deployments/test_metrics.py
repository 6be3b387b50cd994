"""The metrics are recorded where they should be: Ray's metric classes replaced by a fake that
keeps what each one records, the ingress, prefill queue and decode replica driven without
Ray. Every declared metric is recorded by one of them, with the served model's name."""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.errors import ModelNotFoundError, QueueFullError
from app.messages import FinishReason, PrefillRequest, StreamStart, TokenEvent
from app.prefill_queue import PrefillQueue
from app.sampling import SamplingParams
from deployments import metrics
from deployments.decode_server import DecodeServer
from deployments.ingress import Ingress
from deployments.protocol import ChatCompletionRequest, Endpoint
from deployments.replica import DecodeReplica
from deployments.request_trace import RequestTrace, TraceHistory

MODEL = "test-model"


class _Fake:
    """Keeps (value, tags) of every record, by metric name, in ``RECORDS``."""

    def __init__(self, name: str, description: str = "", boundaries: Any = None,
                 tag_keys: tuple[str, ...] = ()) -> None:
        self.name, self.tag_keys, self.default_tags = name, tag_keys, {}

    def set_default_tags(self, tags: dict[str, str]) -> None:
        self.default_tags = tags

    def record(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if isinstance(self, Counter):
            assert value > 0, (self.name, value)  # Ray's counters refuse 0
        tags = {**self.default_tags, **(tags or {})}
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        RECORDS[self.name].append((value, tags))

    inc = observe = set = record

    @property
    def info(self) -> dict[str, Any]:
        return {"name": self.name, "tag_keys": self.tag_keys, "default_tags": self.default_tags}


RECORDS: dict[str, list[tuple[float, dict[str, str]]]] = defaultdict(list)
Counter = type("Counter", (_Fake,), {})


@pytest.fixture
def records(monkeypatch):
    RECORDS.clear()
    monkeypatch.setattr(metrics, "Counter", Counter)
    for cls in ("Gauge", "Histogram"):
        monkeypatch.setattr(metrics, cls, type(cls, (_Fake,), {}))
    return RECORDS


def _values(name: str, **tags: str) -> list[float]:
    return [v for v, t in RECORDS[name] if all(t.get(k) == x for k, x in tags.items())]


def test_names_units_and_labels():
    """vLLM's names where vLLM has the quantity, seconds and bytes, model_name everywhere."""
    names = metrics.declared_names()
    assert {"vllm_time_to_first_token_seconds", "vllm_inter_token_latency_seconds",
            "vllm_request_time_per_output_token_seconds", "vllm_e2e_request_latency_seconds",
            "vllm_prompt_tokens_total", "vllm_generation_tokens_total",
            "vllm_request_success_total", "vllm_num_requests_running",
            "vllm_num_requests_waiting", "vllm_kv_cache_usage_perc"} <= names
    for name in names:
        assert re.fullmatch(r"(vllm|splitserve)_[a-z0-9_]+", name), name
        assert not re.search(r"_ms\b|_ms_", name), name
    for cls in (metrics.IngressMetrics, metrics.PrefillMetrics, metrics.DecodeMetrics):
        for m in cls(MODEL).metrics():
            assert m.info["tag_keys"][0] == "model_name"
            assert m.info["default_tags"]["model_name"] == MODEL


class _Path:
    """A SplitPath that streams ``tokens`` (or fails with ``error`` after them)."""

    def __init__(self, tokens: list[int], error: BaseException | None = None) -> None:
        self.tokens, self.error = tokens, error

    async def resumable_stream(self, preq, trace, shared=None):
        trace.stream_start = StreamStart("node", 1024, 0.01, 0.0, 0.02, prefill_done_at=1.0)
        for i, tok in enumerate(self.tokens):
            await asyncio.sleep(0.001)
            last = i == len(self.tokens) - 1 and self.error is None
            yield TokenEvent(preq.request_id, tok, i, FinishReason.STOP if last else None)
        if self.error is not None:
            raise self.error


def _ingress(tokenizer, path: _Path) -> Any:
    # the class under Serve's ASGI wrapper (whose __del__ expects a running replica)
    ing = object.__new__(Ingress.func_or_class.__mro__[1])
    ing.path, ing.tokenizer, ing.model_name = path, tokenizer, MODEL
    ing.metrics = metrics.IngressMetrics(MODEL)
    ing.in_flight = 0
    ing.history = TraceHistory(0)
    ing.admission = None
    ing.args = SimpleNamespace(ingress=SimpleNamespace(max_in_flight=1))
    return ing


async def _answer(ing, n_prompt: int = 5) -> list:
    preq = PrefillRequest("cmpl-1", tuple(range(1, n_prompt + 1)),
                          SamplingParams(max_tokens=8, temperature=0.0))
    return [d async for d in ing.deltas(Endpoint.COMPLETION, preq, RequestTrace())]


async def test_ingress_records_an_answer(records, smollm_tokenizer):
    tokens = smollm_tokenizer.encode(" one two three")
    await _answer(_ingress(smollm_tokenizer, _Path(tokens)))
    n = len(tokens)
    assert len(_values("vllm_time_to_first_token_seconds")) == 1
    assert len(_values("vllm_inter_token_latency_seconds")) == n - 1
    assert all(v > 0 for v in _values("vllm_inter_token_latency_seconds"))
    assert len(_values("vllm_request_time_per_output_token_seconds")) == 1
    [e2e] = _values("vllm_e2e_request_latency_seconds")
    [ttft] = _values("vllm_time_to_first_token_seconds")
    assert 0 < ttft < e2e < 5  # seconds, not milliseconds
    assert _values("vllm_prompt_tokens_total") == [5]
    assert sum(_values("vllm_generation_tokens_total")) == n
    assert _values("vllm_request_prompt_tokens") == [5]
    assert _values("vllm_request_generation_tokens") == [n]
    assert _values("vllm_request_success_total", finished_reason="stop") == [1]
    assert _values("splitserve_requests_total", route="completion", outcome="ok") == [1]
    assert _values("splitserve_ingress_in_flight") == [1, 0]
    assert all(t["model_name"] == MODEL for recs in records.values() for _, t in recs)


async def test_ingress_counts_failures_and_refusals_by_type(records, smollm_tokenizer):
    ing = _ingress(smollm_tokenizer, _Path([100, 101], error=QueueFullError("full")))
    with pytest.raises(QueueFullError):
        await _answer(ing)
    assert _values("splitserve_requests_total", outcome="QueueFullError") == [1]
    assert not records["vllm_request_success_total"]
    assert sum(_values("vllm_generation_tokens_total")) == 2

    with pytest.raises(ModelNotFoundError):
        ing.prepare(Endpoint.CHAT, ChatCompletionRequest(
            model="other", messages=[{"role": "user", "content": "hi"}]), "client-1")
    assert _values("splitserve_requests_total", route="chat",
                   outcome="ModelNotFoundError") == [1]


async def test_ingress_counts_a_client_that_left_as_abort(records, smollm_tokenizer):
    ing = _ingress(smollm_tokenizer, _Path(smollm_tokenizer.encode(" a b c d")))
    preq = PrefillRequest("cmpl-2", (1, 2), SamplingParams(max_tokens=8, temperature=0.0))
    stream = ing.deltas(Endpoint.CHAT, preq, RequestTrace())
    await stream.__anext__()
    await stream.aclose()
    assert _values("vllm_request_success_total", finished_reason="abort") == [1]
    assert _values("splitserve_requests_total", outcome="cancelled") == [1]


async def test_prefill_queue_records_passes_load_and_cache(records, tiny_model):
    core = EngineCore(EngineConfig(prefill_chunk_tokens=16, prefix_cache_mb=1),
                      model=tiny_model)
    queue = PrefillQueue(core, 0.0, metrics.PrefillMetrics(MODEL))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    await queue.enqueue(PrefillRequest("a", tuple(range(10, 50)), greedy))
    await queue.enqueue(PrefillRequest("b", tuple(range(10, 50)), greedy))  # cached prefix
    assert len(_values("splitserve_prefill_batch_size")) == queue.passes >= 3
    assert sum(_values("splitserve_prefill_batch_tokens")) == queue.tokens_total
    assert 0 < sum(_values("splitserve_prefill_compute_seconds")) < 60
    assert len(_values("splitserve_kv_package_bytes")) == 2
    assert _values("splitserve_prefill_waiting_tokens")[-1] == 0
    assert max(_values("splitserve_prefill_waiting_tokens")) == 40
    assert _values("vllm_num_requests_waiting")[-1] == 0
    assert sum(_values("vllm_prefix_cache_queries_total")) >= 80
    assert sum(_values("vllm_prefix_cache_hits_total")) > 0
    assert _values("splitserve_prefix_cache_bytes")[-1] > 0


def test_prefix_cache_evictions_are_counted_once(records):
    m = metrics.PrefillMetrics(MODEL)
    for evictions in (0, 3, 3, 5):
        m.record_prefix_cache(SimpleNamespace(queried_tokens=10, hit_tokens=4,
                                              evictions=evictions, bytes=1))
    assert sum(_values("splitserve_prefix_cache_evictions_total")) == 5
    assert sum(_values("vllm_prefix_cache_queries_total")) == 10


def test_colocated_prefill_leaves_the_waiting_count_to_decode(records):
    metrics.PrefillMetrics(MODEL, count_waiting=False).record_waiting(7, 2)
    assert _values("splitserve_prefill_waiting_tokens") == [7]
    assert not records["vllm_num_requests_waiting"]


def _decode_replica(waiting_prefills: int = 0) -> Any:
    stats = SimpleNamespace(kv_tokens_used=256, kv_tokens_budget=1024)
    loop = SimpleNamespace(
        decoder=SimpleNamespace(steps=5, stats=lambda: stats),
        step_times=[0.01, 0.02, 0.03, 0.04, 0.05], num_active=3, num_waiting=1)
    return SimpleNamespace(loop=loop, metrics=metrics.DecodeMetrics(MODEL),
                           prefills_waiting=lambda: waiting_prefills)


def test_decode_replica_records_steps_once_and_its_batch(records):
    replica = _decode_replica(waiting_prefills=2)
    assert DecodeReplica.record_metrics(replica, 2) == 5
    assert _values("splitserve_decode_step_seconds") == [0.03, 0.04, 0.05]
    assert DecodeReplica.record_metrics(replica, 5) == 5  # no new step: nothing observed
    assert len(_values("splitserve_decode_step_seconds")) == 3
    assert _values("vllm_num_requests_running")[-1] == 3
    assert _values("vllm_num_requests_waiting")[-1] == 3  # 1 for a row + 2 prefilling
    assert _values("vllm_kv_cache_usage_perc")[-1] == 0.25
    assert _values("splitserve_decode_kv_tokens")[-1] == 256


def test_each_engine_part_s_path_is_a_gauge(records, tiny_model):
    """splitserve_kernel_path{kind, path}: 1 for the path each part runs, as the runner
    reports it (a tiny model left unpacked runs torch's products and the modules' step)."""
    from app.config import EngineConfig
    from app.model_runner import ModelRunner

    paths = ModelRunner(tiny_model, EngineConfig(kernels={"linear": "torch"})).kernel_paths()
    assert paths["linear"] == "torch" and paths["decode_step"] == "modules"
    assert paths["pass_layers"] == "modules"
    metrics.KernelMetrics(MODEL).record(paths)
    assert _values("splitserve_kernel_path", kind="linear", path="torch") == [1]
    assert _values("splitserve_kernel_path", kind="decode_step", path="modules") == [1]
    assert _values("splitserve_kernel_path", kind="pass_layers", path="modules") == [1]
    # the kernels' vectors on this CPU, whatever the parts take
    assert _values("splitserve_kernel_path", kind="vectors", path=paths["vectors"]) == [1]
    assert paths["vectors"] in ("avx512", "avx2", "avx2_kept", "none")
    assert len(RECORDS["splitserve_kernel_path"]) == 6


async def test_decode_server_records_the_kv_hop(records):
    async def stream(start, package, feed):
        yield start
        yield "token"

    package = SimpleNamespace(kv_nbytes=4096, created_at=0.0, prefill_s=0.01,
                              cached_tokens=0)
    server = SimpleNamespace(metrics=metrics.DecodeMetrics(MODEL), node_id="n",
                             replica_id="r", kv_bytes_received=0, hop_s_total=0.0,
                             _stream=stream, feeds={})
    ref = asyncio.get_running_loop().create_future()
    ref.set_result(package)
    out = [e async for e in DecodeServer.func_or_class.generate(server, [ref])]
    assert isinstance(out[0], StreamStart) and out[1:] == ["token"]
    assert _values("splitserve_kv_hop_bytes_total") == [4096]
    assert len(_values("splitserve_kv_hop_seconds")) == 1


async def test_every_declared_metric_is_recorded(records, smollm_tokenizer, tiny_model):
    """Each test above covers some metrics; together, all of them."""
    seen: set[str] = set()
    for run in (lambda: test_ingress_records_an_answer(records, smollm_tokenizer),
                lambda: test_prefill_queue_records_passes_load_and_cache(records, tiny_model),
                lambda: test_prefix_cache_evictions_are_counted_once(records),
                lambda: test_decode_replica_records_steps_once_and_its_batch(records),
                lambda: test_each_engine_part_s_path_is_a_gauge(records, tiny_model),
                lambda: test_decode_server_records_the_kv_hop(records)):
        result = run()
        if asyncio.iscoroutine(result):
            await result
        seen |= set(records)
        records.clear()
    assert metrics.declared_names() - seen == set()
