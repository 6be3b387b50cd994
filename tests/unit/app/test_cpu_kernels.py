"""The engine's own CPU matrix kernel (app/csrc/panel_gemm.c): the products F.linear gives,
every row bit for bit the same in any batch and on any number of threads."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from app import cpu_kernels
from app.config import EngineConfig
from app.packed_linear import PanelLinear, pack_linears, resolve_layout

# Only a CPU the kernel is not written for, or a machine without a C compiler, skips these:
# on an AVX2 machine with a compiler a build that fails is a failure.
pytestmark = pytest.mark.skipif(
    cpu_kernels.cpu_unsupported() is not None or cpu_kernels._compiler() is None,
    reason=f"{cpu_kernels.cpu_unsupported() or 'no C compiler'}")


def _linear(n: int, k: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def test_the_kernel_builds_and_is_cached(tmp_path):
    assert cpu_kernels.kernel_unavailable() is None
    lib = cpu_kernels.load_kernel()
    assert lib is cpu_kernels.load_kernel()  # built once per process
    assert lib.panel_nr() == 16
    # the cached file is named by the source's hash: an edited kernel is rebuilt
    assert cpu_kernels.library_path(tmp_path).name.startswith("splitserve-cpu-")
    assert cpu_kernels.library_path(tmp_path).parent == tmp_path / "kernels"


def test_a_fresh_cache_dir_builds_the_library_there_and_reports_the_build_time(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_lib", None)  # as a new process would start
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    with caplog.at_level("INFO", logger="app.cpu_kernels"):
        lib = cpu_kernels.load_kernel(tmp_path)
    assert cpu_kernels.library_path(tmp_path).is_file()
    assert lib.panel_nr() == 16
    assert any(r.getMessage().startswith("built the CPU kernels in ") for r in caplog.records)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k", "bias"), [(96, 64, True), (200, 77, False), (16, 576, True),
                                              (7, 33, True), (1040, 48, False), (48, 700, True)])
@torch.inference_mode()
def test_products_equal_f_linear(n, k, bias, threads):
    linear = _linear(n, k, bias)
    panel = PanelLinear(linear)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 48, 49, 130):
            x = torch.randn(rows, k)
            torch.testing.assert_close(panel(x), F.linear(x, linear.weight, linear.bias),
                                       rtol=1e-5, atol=1e-5)
        x = torch.randn(3, 9, k)[:, ::2]  # batched and not contiguous
        out = panel(x)
        assert out.shape == (3, 5, n)
        torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)
        assert panel(torch.randn(0, k)).shape == (0, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("k", [576, 700])
@torch.inference_mode()
def test_a_row_is_bit_for_bit_the_same_in_any_batch_and_on_any_threads(k):
    """Also across the paths: more than 48 rows with k over 256 go through k in slices
    (three of 192 at 576, three of 234 and 232 at 700), fewer through whole panels."""
    linear = _linear(1536, k, True, seed=4)
    panel = PanelLinear(linear)
    batch = torch.randn(60, k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [panel(batch[i:i + 1]) for i in range(batch.shape[0])]
        together = panel(batch)
        # decode-sized batches: blocks of six rows and the rows they leave over (1-5)
        small = {rows: panel(batch[:rows]) for rows in range(2, 14)}
        torch.set_num_threads(2)
        together_2 = panel(batch)
        small_2 = {rows: panel(batch[:rows]) for rows in (3, 8, 11)}
        alone_2 = panel(batch[11:12])
    finally:
        torch.set_num_threads(before)
    for i, row in enumerate(alone):
        assert torch.equal(together[i:i + 1], row), i
        assert torch.equal(together_2[i:i + 1], row), i
    for rows, out in [*small.items(), *small_2.items()]:
        assert torch.equal(out, torch.cat(alone[:rows])), rows
    assert torch.equal(alone_2, alone[11])


def test_concurrent_callers_each_get_their_own_product():
    """Threads multiplying at once (prefill and decode engines in one process), each on an
    OpenMP team of two: every product right."""
    linear = _linear(1024, 256, True, seed=2)
    panel = PanelLinear(linear)
    inputs = [torch.randn(8 + i, 256) for i in range(4)]
    with torch.inference_mode():
        expected = [F.linear(x, linear.weight, linear.bias) for x in inputs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with torch.inference_mode():
                for _ in range(50):
                    torch.testing.assert_close(panel(inputs[i]), expected[i], rtol=1e-5,
                                               atol=1e-5)
        except BaseException as exc:  # reported below
            errors.append(exc)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    finally:
        torch.set_num_threads(before)
    assert errors == []


def test_autograd_and_other_dtypes_fall_back_to_f_linear():
    linear = _linear(32, 16, True)
    panel = PanelLinear(linear)
    x = torch.randn(4, 16, requires_grad=True)
    panel(x).sum().backward()
    assert x.grad is not None and linear.weight.grad is not None
    x64 = torch.randn(3, 16, dtype=torch.float64)
    with torch.inference_mode():
        # F.linear over the weight cast to the input's dtype, never float64 bytes read as
        # float32 by the kernel
        torch.testing.assert_close(panel(x64), F.linear(x64, linear.weight.double(),
                                                        linear.bias.double()))
        panel.to(torch.float64)  # weight and panels cast: F.linear on the cast weight
        torch.testing.assert_close(panel(x64), F.linear(x64, linear.weight, linear.bias))


def test_auto_layout_picks_panels_and_the_config_checks_the_name():
    assert resolve_layout("auto") == "panels"
    assert resolve_layout("onednn") == "onednn"
    with pytest.raises(ValueError, match=r"kernels\.linear"):
        EngineConfig(kernels={"linear": "fast"})
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert pack_linears(model) == 2
    assert all(isinstance(m, PanelLinear) for m in (model[0], model[2]))


async def test_decode_reads_the_pool_in_place_unless_turned_off():
    """The runner's decode steps use the in-place attention kernel by default; with
    ``kernels.attention: false`` they gather and call SDPA; the greedy tokens of a batch
    of different lengths are generate()'s either way."""
    from app.engine_core import EngineCore
    from tests.conftest import engine_greedy, hf_greedy, make_tiny_model

    prompts = [[5, 9, 13, 200, 7], list(range(100, 160)), [300, 41, 8], [77] * 30]
    expected = [hf_greedy(make_tiny_model(seed=6), p, 10) for p in prompts]
    for on in (True, False):
        config = EngineConfig(max_batch_size=8, kernels={"attention": on, "linear": "torch"})
        core = EngineCore(config, model=make_tiny_model(seed=6))
        assert core.runner.inplace_attention is on
        if not on:
            assert "turned off" in core.runner.inplace_reason
        outs, _ = await engine_greedy(core, prompts, 10)
        assert outs == expected, on


@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_place_attention_equals_sdpa_over_each_rows_own_slots(head_dim, threads):
    """The attention kernel straight on a pool: rows of lengths around its blocks of eight
    keys, scattered slots, grouped-query heads (9 over 3, SmolLM2's), head_dim 64 (its
    specialised path) and 16 (the general one)."""
    torch.manual_seed(1)
    lib = cpu_kernels.load_kernel()
    kv_heads, group, slots = 3, 3, 2048
    pool = torch.randn(2, slots, kv_heads, head_dim)
    lengths = [1, 7, 8, 9, 70, 321]
    order = torch.randperm(slots)
    per_row, start = [], 0
    for n in lengths:
        per_row.append(order[start:start + n])
        start += n
    read = torch.cat(per_row)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(len(lengths), kv_heads * group, head_dim)
    out = torch.empty_like(q)
    assert lib.paged_decode_attention(
        q.data_ptr(), pool[0].data_ptr(), pool[1].data_ptr(), slots, kv_heads, head_dim, group,
        read.data_ptr(), read.numel(), offsets.data_ptr(), len(lengths), 0.125, out.data_ptr(),
        threads, 0) == 0
    for b, slots_b in enumerate(per_row):
        k = pool[0, slots_b].transpose(0, 1).repeat_interleave(group, 0)  # [heads, n, hd]
        v = pool[1, slots_b].transpose(0, 1).repeat_interleave(group, 0)
        ref = F.scaled_dot_product_attention(q[b][:, None], k, v, scale=0.125)[:, 0]
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_in_place_attention_over_a_bf16_pool_is_the_float32_kernel_over_its_values(head_dim,
                                                                                   threads):
    """A bf16 pool (kv_bf16): each key and value widened to float32 in registers, so the
    output is, to the bit, the float32 kernel's over a pool holding the same values."""
    torch.manual_seed(3)
    lib = cpu_kernels.load_kernel()
    kv_heads, group, slots = 3, 3, 1024
    pool = torch.randn(2, slots, kv_heads, head_dim).to(torch.bfloat16)
    wide = pool.float()
    lengths = [1, 9, 64, 333]
    read = torch.randperm(slots)[: sum(lengths)]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(len(lengths), kv_heads * group, head_dim)
    outs = []
    for p, bf in ((pool, 1), (wide, 0)):
        out = torch.empty_like(q)
        assert lib.paged_decode_attention(
            q.data_ptr(), p[0].data_ptr(), p[1].data_ptr(), slots, kv_heads, head_dim, group,
            read.data_ptr(), read.numel(), offsets.data_ptr(), len(lengths), 0.125,
            out.data_ptr(), threads, bf) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_a_float32_model_with_bf16_kv_keeps_a_bf16_pool_and_rounds_as_torch(monkeypatch):
    """kv_dtype bfloat16 on a float32 model: the decode pool is bf16 (half the bytes a step's
    attention reads) where the in-place kernel reads it, and the fused decode step writes a
    new key/value rounded to bf16 as torch rounds it (nearest even): layer 0's write equals
    torch's rounding of what a float32 pool receives; a package joins it as a plain copy;
    with the kernel turned off, the pool stays float32."""
    from app.kv_cache import contiguous_tables
    from app.model_runner import ModelRunner
    from tests.conftest import make_tiny_model

    runners = {}
    for kv in ("bfloat16", "float32"):
        model = make_tiny_model(seed=7)
        pack_linears(model, layout="panels")
        runners[kv] = ModelRunner(model, EngineConfig(kv_dtype=kv))
    bf, f32 = runners["bfloat16"], runners["float32"]
    if not bf.inplace_attention:
        pytest.skip(f"in-place decode attention unavailable: {bf.inplace_reason}")
    assert bf.pool_dtype == torch.bfloat16 and f32.pool_dtype == torch.float32
    assert bf.fused is not None and bf.kernel_paths()["decode_step"] == "fused"
    prompts = [list(range(40, 77)), [9, 8, 7, 6, 5]]
    tables = contiguous_tables(2, 64, 16)
    results = {}
    for kv, runner in runners.items():
        cache = runner.make_kv_cache(8, 16)
        assert cache.layers[0].dtype == runner.pool_dtype
        _, pkgs = runner.forward_prefill(prompts)
        for table, pkg in zip(tables, pkgs, strict=True):
            cache.write(table, pkg)
        runner.decode(cache, tables, [3, 4], [len(p) for p in prompts])
        results[kv] = [cache.read(t, len(p) + 1) for t, p in zip(tables, prompts, strict=True)]
    for got, want, p in zip(results["bfloat16"], results["float32"], prompts, strict=True):
        assert got.dtype == torch.bfloat16
        # the package's positions (the same prefill) and layer 0's new one: torch's rounding
        assert torch.equal(got[:, :, :, : len(p)], want[:, :, :, : len(p)].to(torch.bfloat16))
        assert torch.equal(got[0, :, :, len(p)], want[0, :, :, len(p)].to(torch.bfloat16))
    off = make_tiny_model(seed=7)
    pack_linears(off, layout="panels")
    runner = ModelRunner(off, EngineConfig(kv_dtype="bfloat16", kernels={"attention": False}))
    assert runner.pool_dtype == torch.float32 and not runner.inplace_attention


def test_in_place_attention_gives_a_row_the_same_bits_alone_and_in_a_batch():
    """head_dim 64's path reads a row's every KV head at once where the batch has a row per
    thread, and one KV head a task where it has fewer (a lone row on two threads): the
    sums run in the same order either way, so a row's output is the same to the bit alone or
    in a batch, on one thread or two; 14 query heads over 2 KV heads (a Qwen2-0.5B's)."""
    torch.manual_seed(2)
    lib = cpu_kernels.load_kernel()
    kv_heads, group, hd, slots = 2, 7, 64, 1024
    pool = torch.randn(2, slots, kv_heads, hd)
    lengths = [5, 300, 64]
    read = torch.randperm(slots)[: sum(lengths)]
    q = torch.randn(len(lengths), kv_heads * group, hd)

    def attend(rows: list[int], threads: int) -> torch.Tensor:
        parts = [read[sum(lengths[:b]) : sum(lengths[: b + 1])] for b in rows]
        offsets = torch.tensor([0, *torch.tensor([len(p) for p in parts]).cumsum(0).tolist()])
        r, qs = torch.cat(parts), q[rows].contiguous()
        out = torch.empty_like(qs)
        assert lib.paged_decode_attention(
            qs.data_ptr(), pool[0].data_ptr(), pool[1].data_ptr(), slots, kv_heads, hd, group,
            r.data_ptr(), r.numel(), offsets.data_ptr(), len(rows), 0.125, out.data_ptr(),
            threads, 0) == 0
        return out

    batch = attend([0, 1, 2], 1)
    assert torch.equal(attend([0, 1, 2], 2), batch)
    for b in range(len(lengths)):
        for threads in (1, 2):
            assert torch.equal(attend([b], threads)[0], batch[b]), (b, threads)
        slots_b = read[sum(lengths[:b]) : sum(lengths[: b + 1])]
        k = pool[0, slots_b].transpose(0, 1).repeat_interleave(group, 0)
        v = pool[1, slots_b].transpose(0, 1).repeat_interleave(group, 0)
        ref = F.scaled_dot_product_attention(q[b][:, None], k, v, scale=0.125)[:, 0]
        torch.testing.assert_close(batch[b], ref, rtol=1e-5, atol=1e-5)


def _no_avx512() -> bool:
    """True where the kernel loads but the CPU lacks AVX-512 (elsewhere the module's own
    skip applies; loading is not tried at import, where a failed build would break
    collection)."""
    return cpu_kernels.kernel_unavailable() is None and not (
        cpu_kernels.load_kernel().panel_has_avx512())


@pytest.mark.skipif(_no_avx512(),
                    reason="this CPU has no AVX-512: the products take the AVX2 path only")
@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_avx512_and_avx2_paths_give_the_same_bits(threads):
    """Where the CPU has AVX-512, products of four rows or more go through zmm tiles of up to
    12 rows x 2 panels: every row bit for bit what the AVX2 path gives, so a row's result
    still does not depend on the batch it rides in or on the machine's vector width.
    Shapes cover an odd panel count (a lone panel at the end), padded last panels and the
    grouped prefill path (more than 48 rows)."""
    lib = cpu_kernels.load_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k, bias in [(1536, 576, True), (200, 77, False), (7, 33, True),
                           (1040, 48, False), (80, 1536, True)]:
            panel = PanelLinear(_linear(n, k, bias, seed=n))
            for rows in (1, 3, 4, 5, 8, 11, 12, 13, 25, 48, 49, 130):
                x = torch.randn(rows, k)
                assert lib.panel_set_avx512(0) == 0
                avx2 = panel(x)
                assert lib.panel_set_avx512(1) == 1
                avx512 = panel(x)
                assert torch.equal(avx2, avx512), (n, k, rows)
                torch.testing.assert_close(avx512, F.linear(x, panel.weight, panel.bias),
                                           rtol=1e-5, atol=1e-5)
    finally:
        lib.panel_set_avx512(1)
        torch.set_num_threads(before)


@torch.inference_mode()
def test_kept_to_avx2_every_wider_path_reports_absent_and_products_keep_their_bits():
    """``panel_limit_avx2`` (``SPLITSERVE_KERNEL_ISA=avx2``): the AVX-512 tiles and the bf16
    and VNNI dot products report absent, as on an AVX2-only CPU, the weights' plan takes the
    widened kinds, a dot-product call is refused, and the products give the bits the AVX2
    path gives; lifting it gives back what the CPU has."""
    from app.packed_linear import weight_plan

    lib = cpu_kernels.load_kernel()
    kept = lib.panel_avx2_only()  # 1 where the whole run is (make test-kernels-avx2)
    lib.panel_limit_avx2(0)
    has = (lib.panel_has_avx512(), lib.panel_has_avx512bf16(), lib.panel_has_avx512vnni())
    panel = PanelLinear(_linear(200, 77, True, seed=5))
    x = torch.randn(13, 77)
    assert lib.panel_set_avx512(0) == 0
    avx2 = panel(x)
    try:
        assert lib.panel_limit_avx2(1) == 1 and lib.panel_avx2_only() == 1
        assert (lib.panel_has_avx512(), lib.panel_has_avx512bf16(),
                lib.panel_has_avx512vnni()) == (0, 0, 0)
        assert lib.panel_uses_avx512() == 0 and lib.panel_set_avx512(1) == 0
        assert cpu_kernels.vector_path() == "avx2_kept"  # the kernel_path gauge's "vectors"
        assert torch.equal(panel(x), avx2)
        assert weight_plan(EngineConfig(dtype="bfloat16"))[1] == "bfloat16"
        assert weight_plan(EngineConfig(weights="int8"))[1] == "int8"
        y = torch.empty(1, 16)
        status = lib.linear_bf16dp(x.data_ptr(), 1, 32, x.data_ptr(), 16, None,
                                   y.data_ptr(), 1)
        with pytest.raises(cpu_kernels.KernelError, match="linear_bf16dp"):
            cpu_kernels.check(status, "linear_bf16dp")
        lib.panel_limit_avx2(0)
        assert lib.panel_avx2_only() == 0
        assert (lib.panel_has_avx512(), lib.panel_has_avx512bf16(),
                lib.panel_has_avx512vnni()) == has
        assert lib.panel_uses_avx512() == has[0]
        assert cpu_kernels.vector_path() == ("avx512" if has[0] else "avx2")
    finally:
        lib.panel_limit_avx2(kept)
