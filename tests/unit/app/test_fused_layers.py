"""Prefill and mixed passes' layers in two calls each to the engine's C kernel
(app.fused_layers, app/csrc/prefill_layer.c): the logits and KV the model's own modules give,
row values that do not depend on the rest of the pass, a clear reason wherever a model's
passes run through its modules, and entry points that refuse bad arguments."""

from __future__ import annotations

import pytest
import torch

from app import cpu_kernels
from app.config import EngineConfig
from app.engine_core import EngineCore
from app.fused_layers import FusedLayers
from app.model_runner import ModelRunner
from app.packed_linear import pack_linears
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(
    cpu_kernels.cpu_unsupported() is not None or cpu_kernels._compiler() is None,
    reason=f"{cpu_kernels.cpu_unsupported() or 'no C compiler'}")

BIASES = {"attention_bias": True, "mlp_bias": True}


def _runner(fused: bool, weights: str = "float32", **overrides) -> ModelRunner:
    model = make_tiny_model(seed=4, **overrides)
    pack_linears(model, layout="panels", weights=weights)
    return ModelRunner(model, EngineConfig(kernels={"fused_layers": fused}))


def _chunked(runner: ModelRunner, prompts: list[list[int]], chunk: int):
    """Each prompt prefilled in chunks of ``chunk`` tokens, all rows in one pass per chunk:
    every pass's logits, and each prompt's whole KV."""
    kvs: list[torch.Tensor | None] = [None] * len(prompts)
    logits = []
    for start in range(0, max(map(len, prompts)), chunk):
        rows = [i for i, p in enumerate(prompts) if len(p) > start]
        out, new = runner.forward_prefill([prompts[i][start : start + chunk] for i in rows],
                                          [kvs[i] for i in rows])
        logits.append(out)
        for i, kv in zip(rows, new, strict=True):
            kvs[i] = kv if kvs[i] is None else torch.cat([kvs[i], kv], dim=3)
    return logits, kvs


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("extra", [{}, BIASES], ids=["no-bias", "biases"])
def test_fused_prefill_gives_the_logits_and_kv_of_the_models_modules(threads, extra):
    """Rows of different lengths (one 1 token, one of 70: above the kernel's parallel
    threshold), whole and in chunks that continue over their past."""
    fused, plain = _runner(True, **extra), _runner(False, **extra)
    assert fused.fused_layers is not None and plain.fused_layers is None
    assert "turned off" in plain.fused_layers_reason
    prompts = [[5, 9, 33, 100, 7], list(range(40, 110)), [8], [300, 41, 8, 2, 2, 17, 90]]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for chunk in (128, 16):
            got, got_kv = _chunked(fused, prompts, chunk)
            want, want_kv = _chunked(plain, prompts, chunk)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                assert torch.equal(a.argmax(-1), b.argmax(-1))
            for a, b in zip(got_kv, want_kv, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_fused_prefill_reads_the_same_panels_for_other_weight_kinds(weights):
    fused, plain = _runner(True, weights), _runner(False, weights)
    prompts = [list(range(3, 60)), [11, 12, 13]]
    got, got_kv = fused.forward_prefill(prompts)
    want, want_kv = plain.forward_prefill(prompts)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(got_kv, want_kv, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_values_do_not_depend_on_the_rest_of_the_pass(threads):
    """Alone (41 rows: the products share out their panels) and in a pass of 255 rows (on
    two threads each call runs over blocks of rows, every thread its own products)."""
    runner = _runner(True)
    prompt = list(range(200, 241))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone, alone_kv = runner.forward_prefill([prompt])
        batch, batch_kv = runner.forward_prefill([[7] * 64, prompt, list(range(5, 90))])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone[0], batch[1])
    assert torch.equal(alone_kv[0], batch_kv[1])


def test_a_mixed_pass_gives_what_the_models_modules_give():
    """Two decode rows over the paged pool and two chunks (one continuing its past) in one
    pass: the same logits and chunk KV through the fused layers as through the modules."""
    prompts = [[5, 9, 33, 100, 7, 8], list(range(60, 90))]
    results = []
    for on in (True, False):
        runner = _runner(on)
        cache = runner.make_kv_cache(32, 4)
        tables = [list(range(0, 4)), list(range(4, 12))]
        _, kvs = runner.forward_prefill(prompts)
        for table, kv in zip(tables, kvs, strict=True):
            cache.write(table, kv)
        _, past = runner.forward_prefill([list(range(100, 140))])
        results.append(runner.forward_mixed(
            cache, tables, [3, 4], [len(p) for p in prompts],
            [list(range(140, 170)), list(range(300, 340))], [past[0], None]))
    (dec_a, chunk_a, kv_a), (dec_b, chunk_b, kv_b) = results
    torch.testing.assert_close(dec_a, dec_b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunk_a, chunk_b, rtol=1e-4, atol=1e-4)
    for a, b in zip(kv_a, kv_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _counting_layers(monkeypatch) -> list:
    """The calls of ``FusedLayers.layer`` (the layer loop's) from here on."""
    calls: list = []
    layer = FusedLayers.layer
    monkeypatch.setattr(FusedLayers, "layer", lambda *a, **kw: calls.append(1) or layer(*a, **kw))
    return calls


def _mixed_one_call_run(runner, decode_rows: int, calls: list):
    """A mixed pass of ``decode_rows`` decode rows, a document's later chunk and a fresh
    prompt's chunk written into their prompts' KV (``into``), and a short prompt with
    neither: the pass's logits, the two buffers, the short prompt's KV and the decode rows'
    KV after it (``calls``: emptied as the pass starts)."""
    lengths = [9, 30][:decode_rows]
    cache = runner.make_kv_cache(16, 4)
    tables = [list(range(0, 4)), list(range(4, 12))][:decode_rows]
    if decode_rows:
        _, kvs = runner.forward_prefill([list(range(20, 20 + n)) for n in lengths])
        for table, kv in zip(tables, kvs, strict=True):
            cache.write(table, kv)
    doc = list(range(200, 250))
    _, [past] = runner.forward_prefill([doc[:21]])
    whole = torch.full((*past.shape[:3], 50, past.shape[4]), float("nan"))
    whole[:, :, :, :21] = past
    fresh = torch.full((*past.shape[:3], 13, past.shape[4]), float("nan"))
    calls.clear()
    dec, logits, kvs = runner.forward_mixed(
        cache, tables, [4, 5][:decode_rows], lengths,
        [doc[21:40], list(range(60, 73)), list(range(80, 87))],
        [whole[:, :, :, :21], fresh[:, :, :, :0], None], [whole, fresh, None])
    assert kvs[0].data_ptr() == whole[:, :, :, 21:].data_ptr()
    assert kvs[2].dtype == runner.kv_dtype and kvs[2].is_contiguous()
    return dec, logits, whole, fresh, kvs[2], [
        cache.read(t, n + 1) for t, n in zip(tables, lengths, strict=True)]


BF16DP = pytest.mark.skipif(
    cpu_kernels.kernel_unavailable() is not None
    or not cpu_kernels.load_kernel().panel_has_avx512bf16(),
    reason="the CPU has no AVX512-BF16")
VNNI = pytest.mark.skipif(
    cpu_kernels.kernel_unavailable() is not None
    or not cpu_kernels.load_kernel().panel_has_avx512vnni(), reason="the CPU has no AVX512-VNNI")
KINDS = [("float32", None), ("float32", "bfloat16"), ("int8", "bfloat16"),
         pytest.param("bfloat16dp", "bfloat16", marks=BF16DP),
         pytest.param("int8dp", "bfloat16", marks=VNNI)]


def _kind_runner(weights: str, kv_dtype: str | None) -> ModelRunner:
    model = make_tiny_model(seed=4)
    pack_linears(model, layout="panels", weights=weights)
    runner = ModelRunner(model, EngineConfig(kv_dtype=kv_dtype))
    assert runner.prefill_bf16 == (weights == "bfloat16dp")
    return runner


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("decode_rows", [2, 0])
@pytest.mark.parametrize(("weights", "kv_dtype"), KINDS)
def test_a_mixed_pass_in_one_call_gives_the_bits_of_the_layer_loop(monkeypatch, threads,
                                                                    decode_rows, weights,
                                                                    kv_dtype):
    """Chunks written into their prompts' KV (or a buffer of their own) beside decode rows
    over the pool: every layer in one kernel call (mixed_layers) gives the same bits as the
    layer-by-layer loop: logits, the chunks' KV, the decode rows' keys and values."""
    runner = _kind_runner(weights, kv_dtype)
    calls = _counting_layers(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one = _mixed_one_call_run(runner, decode_rows, calls)
        assert calls == []  # no layer through Python
        monkeypatch.setattr(FusedLayers, "pass_call", lambda *a, **kw: None)
        loop = _mixed_one_call_run(runner, decode_rows, calls)
        assert len(calls) == runner.model.config.num_hidden_layers
    finally:
        torch.set_num_threads(before)
    for got, want in zip([*one[:5], *one[5]], [*loop[:5], *loop[5]], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # the same bits
    assert one[2][:, :, :, 40:].isnan().all()  # nothing written past the chunk
    assert not one[2][:, :, :, :40].isnan().any() and not one[3].isnan().any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("weights", "kv_dtype"), KINDS)
def test_a_prefill_pass_in_one_call_a_layer_gives_the_bits_of_the_layer_loop(
        monkeypatch, threads, weights, kv_dtype):
    """Rows of different lengths without a past (each row's KV into a buffer of its own),
    and one row continuing its prompt into its KV so far: one kernel call a layer, still
    yielding after each layer (a pass pauses between layers), the same bits as the loop."""
    runner = _kind_runner(weights, kv_dtype)
    calls = _counting_layers(monkeypatch)
    prompts = [[5, 9, 33, 100, 7], list(range(40, 110)), [8]]
    _, [past] = runner.forward_prefill([list(range(300, 330))])

    def run():
        whole = torch.full((*past.shape[:3], 45, past.shape[4]), float("nan"))
        whole[:, :, :, :30] = past
        steps = runner.prefill_layers(prompts)
        done = []
        try:
            while True:
                done.append(next(steps))
        except StopIteration as end:
            logits, kvs = end.value
        chunk = runner.forward_prefill([list(range(330, 345))], [whole[:, :, :, :30]], whole)
        return done, logits, kvs, chunk[0], whole

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls.clear()
        one = run()
        assert calls == []
        monkeypatch.setattr(FusedLayers, "pass_call", lambda *a, **kw: None)
        loop = run()
        assert len(calls) == 2 * runner.model.config.num_hidden_layers
    finally:
        torch.set_num_threads(before)
    assert one[0] == loop[0] == list(range(1, runner.model.config.num_hidden_layers + 1))
    for got, want in zip([one[1], *one[2], one[3], one[4]], [loop[1], *loop[2], loop[3], loop[4]],
                         strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert all(kv.dtype == runner.kv_dtype and kv.is_contiguous() for kv in one[2])
    assert [kv.shape[3] for kv in one[2]] == [len(p) for p in prompts]


def test_a_pass_over_a_past_without_its_buffer_runs_the_layer_loop(monkeypatch):
    """Rows continuing a past handed as a copy (a cached prefix, several rows): the layers
    run one by one, through the model's cache view."""
    runner = _runner(True)
    calls = _counting_layers(monkeypatch)
    _, pasts = runner.forward_prefill([list(range(30, 40)), list(range(50, 54))])
    calls.clear()
    runner.forward_prefill([[7, 8], [9]], pasts)
    assert len(calls) == runner.model.config.num_hidden_layers
    calls.clear()
    runner.forward_mixed(runner.make_kv_cache(8, 4), [], [], [], [[7, 8]], [pasts[0]])
    assert len(calls) == runner.model.config.num_hidden_layers


@pytest.mark.parametrize(("config", "layout", "overrides", "reason"), [
    ({"kernels": {"fused_layers": False}}, "panels", {}, "turned off"),
    ({}, "onednn", {}, "panel-packed"),
    ({}, "panels", {"hidden_act": "gelu"}, "activation"),
])
def test_a_model_the_kernel_does_not_compute_runs_its_passes_through_its_modules(
        config, layout, overrides, reason):
    model = make_tiny_model(seed=1, **overrides)
    pack_linears(model, layout=layout)
    runner = EngineCore(EngineConfig(**config), model=model).runner
    assert runner.fused_layers is None
    assert reason in runner.fused_layers_reason
    assert runner.kernel_paths()["pass_layers"] == "modules"


def test_the_layer_entry_points_refuse_bad_shapes():
    runner = _runner(True)
    layers = runner.fused_layers
    hidden = torch.zeros((0, 1, layers.hidden))  # no rows
    rotary = (torch.zeros((0, layers.head_dim)), torch.zeros((0, layers.head_dim)))
    with pytest.raises(cpu_kernels.KernelError, match="layer_qkv"):
        layers.layer(0, hidden, rotary, None, None)
    lib = cpu_kernels.load_kernel()
    assert lib.layer_mlp(None, 4, 64, None, 64, None, None, None, None, 1e-5, None, None, None,
                         128, None, None, None, 0, None, 1) == -3  # SK_BAD_SHAPE


@pytest.mark.parametrize("rows", [8, 100])
def test_a_refused_product_inside_a_layer_is_the_layers_status(rows):
    """An unknown kind of weight, refused by a product: on the calling thread (8 rows) and
    inside the blocks of rows two threads run (100 rows), the call returns the refusal, and
    the hidden rows stay as they were."""
    lib = cpu_kernels.load_kernel()
    h, heads, hd, inter = 32, 2, 16, 64
    hidden, norm = torch.ones(rows, h), torch.ones(h)
    cos, sin = torch.ones(rows, hd), torch.zeros(rows, hd)
    panels = torch.zeros(4096)
    xn, qkv = torch.empty(rows, h), torch.empty(rows, 3 * heads * hd)
    assert lib.layer_qkv(hidden.data_ptr(), rows, h, norm.data_ptr(), 1e-5, panels.data_ptr(),
                         99, None, None, heads, heads, hd, cos.data_ptr(), sin.data_ptr(),
                         xn.data_ptr(), qkv.data_ptr(), 2) == -4  # SK_BAD_KIND
    att, scratch = torch.zeros(rows, h), torch.empty(rows * (h + 3 * inter))
    assert lib.layer_mlp(hidden.data_ptr(), rows, h, att.data_ptr(), h, panels.data_ptr(),
                         None, None, norm.data_ptr(), 1e-5, panels.data_ptr(), None, None,
                         inter, panels.data_ptr(), None, None, 99, scratch.data_ptr(),
                         2) == -4
    assert torch.equal(hidden, torch.ones(rows, h))  # the product failed before any sum
