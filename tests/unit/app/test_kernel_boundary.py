"""The boundary between Python and the C kernels (app/csrc/kernels.h, app.cpu_kernels): the
bindings are the header's declarations; every entry point given out-of-range slots, blocks,
offsets, starts, zero rows or mismatched widths returns a status that becomes a KernelError
naming the argument, never a crash (the fuzzing runs in a subprocess, so a crash fails the
test, not the suite); the loader chooses its library by the compiler's identity, loads a
prebuilt one where there is no compiler, and refuses a library of another OpenMP runtime."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app import cpu_kernels
from app.cpu_kernels import HEADER, declarations, kernel_unavailable

pytestmark = pytest.mark.skipif(kernel_unavailable() is not None,
                                reason="the kernels need x86-64 with AVX2/FMA and a compiler")


def test_every_export_is_declared_once_and_bound_as_declared():
    lib = cpu_kernels.load_kernel()
    decls = declarations(HEADER.read_text())
    sources = "".join(src.read_text() for src in cpu_kernels.SOURCES)
    # every non-static function the sources define is declared in the header
    defined = set(re.findall(r"^(?:int|long|void|const char \*)\s*(\w+)\(", sources, re.M))
    assert defined == set(decls)
    for name, (restype, argtypes) in decls.items():
        fn = getattr(lib, name)
        assert fn.restype == restype and list(fn.argtypes) == argtypes, name
    # no .c file restates a prototype: each includes the header instead
    for src in cpu_kernels.SOURCES:
        text = src.read_text()
        assert '#include "kernels.h"' in text, src.name
        for name in decls:
            assert not re.search(rf"^\w[\w\s\*]*\b{name}\([^)]*\);", text, re.M), (src, name)
    # decode_step's read, nread, offsets, slots; its eps a float
    assert decls["decode_step"][1][14:18] == [ctypes.c_void_p, ctypes.c_long] * 2
    assert decls["decode_step"][1][11] == ctypes.c_float
    assert decls["sk_status_message"] == (ctypes.c_char_p, [ctypes.c_int])


# Each case: an entry point called with one bad argument; the status it must return.
FUZZ = textwrap.dedent("""
    import torch
    from app import cpu_kernels
    from app.cpu_kernels import KernelError, check
    lib = cpu_kernels.load_kernel()
    P = lambda t: t.data_ptr()
    L = lambda *v: torch.tensor(v, dtype=torch.long)
    slots, kvh, hd, group = 32, 2, 16, 2
    pool = torch.randn(2, slots, kvh, hd)
    q = torch.randn(2, kvh * group, hd); out = torch.empty_like(q)
    def attn(read, offsets, rows=2, nread=None, s=slots, hd_=hd):
        return lib.paged_decode_attention(P(q), P(pool[0]), P(pool[1]), s, kvh, hd_, group,
            P(read), read.numel() if nread is None else nread, P(offsets), rows, 0.25,
            P(out), 1, 0)
    ok = L(0, 1, 2, 3)
    cases = {
        "attention ok": (attn(ok, L(0, 2, 4)), 0),
        "read past the pool": (attn(L(0, 1, 2, slots), L(0, 2, 4)), -7),
        "negative read": (attn(L(0, -1, 2, 3), L(0, 2, 4)), -7),
        "offsets past read": (attn(ok, L(0, 2, 9)), -8),
        "offsets falling": (attn(ok, L(0, 3, 2)), -8),
        "offsets not from 0": (attn(ok, L(1, 2, 4)), -8),
        "nread shorter than offsets": (attn(ok, L(0, 2, 4), nread=3), -8),
        "negative rows": (attn(ok, L(0, 2, 4), rows=-1), -3),
        "zero rows": (attn(ok, L(0), rows=0), 0),
        "head_dim not 8k": (attn(ok, L(0, 2, 4), hd_=12), -1),
        "empty pool": (attn(ok, L(0, 2, 4), s=0), -7),
    }
    ck = lib.paged_slots_check
    offs, past, negative = L(0, 2, 4), L(0, slots), L(-1, 0)  # held: their pointers are read
    cases["write past the pool"] = (ck(P(past), 2, P(ok), 4, P(offs), slots), -6)
    cases["negative write"] = (ck(P(negative), 2, P(ok), 4, P(offs), slots), -6)
    # products
    x = torch.randn(3, 20); p = torch.zeros(lib.panel_floats(40, 20)); y = torch.empty(3, 40)
    lin = lambda m, k, n, wtype=0, scale=None, threads=1: lib.panel_linear_w(
        P(x), m, k, P(p), wtype, scale, n, None, P(y), threads)
    cases.update({
        "product ok": (lin(3, 20, 40), 0), "zero rows product": (lin(0, 20, 40), 0),
        "negative rows product": (lin(-1, 20, 40), -3), "k 0": (lin(3, 0, 40), -3),
        "n 0": (lin(3, 20, 0), -3), "unknown wtype": (lin(3, 20, 40, wtype=9), -4),
        "int8 without scales": (lin(3, 20, 40, wtype=2), -4),
        "int8dp without scales": (lin(3, 20, 40, wtype=4), -4),
        "threads 0": (lin(3, 20, 40, threads=0), -3),
        "element size 4": (lib.panel_pack_bytes(P(x), 20, 3, 20, P(p), 4), -10),
    })
    # prefill attention: starts beyond the padded past, counts out of range
    qq = torch.randn(1, 2, 3, 16); kk = torch.randn(1, 2, 5, 16)
    oo = torch.empty(1, 3, 2, 16)
    def pre(starts, pmax=2, t=5, heads=2, kv=2, batch=1, d=16):
        return lib.prefill_attention(P(qq), *qq.stride()[:3], P(kk), *kk.stride()[:3],
            P(kk), *kk.stride()[:3], P(oo), oo.stride(0), oo.stride(2), oo.stride(1),
            batch, heads, kv, 3, t, d, P(starts), pmax, 0.25, 1)
    cases.update({
        "prefill ok": (pre(L(1)), 0), "start past pmax": (pre(L(3)), -9),
        "negative start": (pre(L(-1)), -9), "t not pmax + s": (pre(L(0), t=6), -3),
        "heads not a multiple": (pre(L(0), heads=3), -3), "zero kv heads": (pre(L(0), kv=0), -3),
        "head_dim 8": (pre(L(0), d=8), -1), "negative batch": (pre(L(0), batch=-1), -3),
    })
    # rows' keys and values into a pool: every slot checked before anything is written
    src = torch.randn(3, kvh, hd); dst = torch.zeros(2, slots, kvh, hd)
    def store(slot_list, n=3, kv=kvh, d=hd, ns=slots):
        return lib.kv_store_rows(P(src), P(src), n, kvh * hd, hd, kv, d, P(slot_list), ns,
                                 P(dst[0]), P(dst[1]), kvh * hd, hd, 0)
    inside, late = L(0, 5, slots - 1), L(0, 5, slots)  # held: their pointers are read
    cases.update({
        "store ok": (store(inside), 0), "store past the pool": (store(late), -6),
        "store negative slot": (store(L(3, -1, 2)), -6),
        "store negative rows": (store(inside, n=-1), -3),
        "store zero kv heads": (store(inside, kv=0), -3),
        "store zero head_dim": (store(inside, d=0), -3),
        "store rows beyond slots": (lib.kv_store_rows(P(src), P(src), 3, kvh * hd, hd, kvh, hd,
                                    None, 2, P(dst[0]), P(dst[1]), kvh * hd, hd, 1), -6),
    })
    assert dst[:, slots - 1].abs().sum() > 0 and dst[:, 3].abs().sum() == 0  # refused: none
    # a mixed pass's layers in one call: its rows, chunks and slots checked before any layer
    import ctypes
    hid = torch.ones(3, 32); into = torch.full((1, 2, 2, 8, 16), 7.0); buf = torch.zeros(4096)
    table, intos = (ctypes.c_void_p * 16)(), (ctypes.c_void_p * 1)(P(into))
    def mixed(m=3, chunk=2, past=0, rows=1, write=L(1), read=L(1), offsets=L(0, 1)):
        lens, pasts, rooms = L(chunk), L(past), L(8)
        return lib.mixed_layers(P(hid), m, 0, 1, table, 32, 2, 2, 16, 64, P(buf), P(buf), 1e-5,
            0.25, rows, P(write), P(read), read.numel(), P(offsets), 4, 0, 1, P(lens),
            P(pasts), P(rooms), intos, 0, 0, P(buf), P(buf), P(buf), P(buf), 2)
    cases.update({
        "mixed rows not the pass": (mixed(chunk=3), -3),
        "mixed chunk past its room": (mixed(chunk=2, past=7), -3),
        "mixed negative past": (mixed(past=-1), -3),
        "mixed empty chunk": (mixed(m=1, chunk=0), -3),
        "mixed write past the pool": (mixed(write=L(4)), -6),
        "mixed read past the pool": (mixed(read=L(9)), -7),
        "mixed offsets past read": (mixed(offsets=L(0, 2)), -8),
    })
    first = lib.mixed_layers(P(hid), 3, -1, 1, table, 32, 2, 2, 16, 64, P(buf), P(buf), 1e-5,
        0.25, 0, None, None, 0, None, 4, 0, 1, P(L(3)), P(L(0)), P(L(8)), intos, 0, 0,
        P(buf), P(buf), P(buf), P(buf), 2)
    cases["mixed negative first layer"] = (first, -3)
    assert (hid == 1).all() and (into == 7.0).all()  # refused: nothing written
    bad = {name: got for name, (got, want) in cases.items() if got != want}
    assert not bad, bad
    try:
        check(-7, "paged_decode_attention")
    except KernelError as exc:
        assert "read: a slot outside the pool" in str(exc) and exc.status == -7
    else:
        raise AssertionError("no KernelError")
    print("FUZZ OK", len(cases))
""")


def test_bad_arguments_get_a_status_never_a_crash():
    proc = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FUZZ OK" in proc.stdout


@pytest.mark.parametrize("corrupt", ["write", "read"])
def test_a_fused_step_with_a_slot_outside_the_pool_raises_and_writes_nothing(corrupt):
    import torch

    from app.attention import PagedDecodeStep
    from app.config import EngineConfig
    from app.model_runner import ModelRunner
    from app.packed_linear import pack_linears
    from tests.conftest import make_tiny_model

    model = make_tiny_model()
    pack_linears(model, layout="panels")
    runner = ModelRunner(model, EngineConfig())
    assert runner.fused is not None
    cache = runner.make_kv_cache(4, 16)
    step = PagedDecodeStep.build(cache, [[0], [1]], [3, 5], inplace=True)
    slots = step.write_slots if corrupt == "write" else step.read_slots
    next(iter(slots.values()))[-1] = cache.num_slots  # one past the pool's last slot
    cache.layers[0].zero_()
    hidden = torch.randn(2, runner.fused.hidden)
    cos = sin = torch.zeros(2, runner.fused.head_dim)
    with pytest.raises(cpu_kernels.KernelError, match=f"{corrupt}: a slot outside the pool"):
        runner.fused(hidden, cos, sin, cache, step)
    assert not cache.layers[0].any()  # checked before any key or value was written


def test_slot_index_refuses_a_table_too_short_or_outside_the_pool():
    import torch

    from app.config import EngineConfig
    from app.model_runner import ModelRunner
    from tests.conftest import make_tiny_model

    cache = ModelRunner(make_tiny_model(), EngineConfig()).make_kv_cache(4, 16)
    assert torch.equal(cache.slot_index([2], 3), torch.tensor([32, 33, 34]))
    with pytest.raises(IndexError, match="need 2 blocks"):
        cache.slot_index([0], 17)
    with pytest.raises(IndexError, match="outside the pool"):
        cache.slot_index([4], 1)


def test_the_loader_chooses_by_compiler_and_loads_a_prebuilt_library(tmp_path, monkeypatch):
    gcc = cpu_kernels.library_path(tmp_path, "gcc: gcc 12.2.0")
    clang = cpu_kernels.library_path(tmp_path, "clang: clang 16.0.6")
    assert gcc != clang and gcc.parent == clang.parent == tmp_path / "kernels"
    # the compiler's own build, to be built when absent
    assert cpu_kernels.choose_library(tmp_path, "gcc: gcc 12.2.0") == (gcc, True)
    gcc.parent.mkdir(parents=True)
    gcc.write_bytes(b"prebuilt")
    assert cpu_kernels.choose_library(tmp_path, "gcc: gcc 12.2.0") == (gcc, False)
    # another compiler builds its own; no compiler takes the prebuilt one
    assert cpu_kernels.choose_library(tmp_path, "clang: clang 16.0.6") == (clang, True)
    assert cpu_kernels.choose_library(tmp_path, "none") == (gcc, False)
    with pytest.raises(RuntimeError, match=r"no C compiler .* and no library"):
        cpu_kernels.choose_library(tmp_path / "empty", "none")


def test_a_library_of_another_openmp_runtime_is_refused(tmp_path):
    ours = Path(cpu_kernels.load_kernel()._name)
    assert cpu_kernels.openmp_mismatch(ours) is None
    clang = tmp_path / "clang.so"
    clang.write_bytes(b"\x7fELF...libomp.so\x00...")
    assert "links libomp.so" in cpu_kernels.openmp_mismatch(clang)
    bare = tmp_path / "bare.so"
    bare.write_bytes(b"\x7fELF...libc.so.6\x00")
    assert "does not link libgomp.so.1" in cpu_kernels.openmp_mismatch(bare)


def test_a_failure_is_retried_when_the_compiler_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failure", ("none", "CPU kernels unavailable: no C compiler"))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_kernels, "compiler_identity", lambda c: "none")
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernels.load_kernel(tmp_path)
    # a compiler appears: the loader tries again (and builds into the new directory)
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "cc")
    monkeypatch.setattr(cpu_kernels, "compiler_identity", lambda c: "cc: fake 1.0")
    built = []
    monkeypatch.setattr(cpu_kernels, "_build", lambda target, compiler: built.append(target)
                        or (_ for _ in ()).throw(RuntimeError("cc failed: fake")))
    with pytest.raises(RuntimeError, match="cc failed: fake"):
        cpu_kernels.load_kernel(tmp_path)
    assert built and built[0].parent == tmp_path / "kernels"


NO_COMPILER = textwrap.dedent("""
    import asyncio, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from app.config import EngineConfig
    from app.engine_core import EngineCore
    from app.packed_linear import pack_linears
    from tests.conftest import engine_greedy, hf_greedy, make_tiny_model
    cache = sys.argv[1]
    try:
        pack_linears(make_tiny_model(seed=4), layout="panels", cache_dir=cache)
        raise SystemExit("packed without a compiler")
    except ValueError as exc:
        assert "no C compiler" in str(exc), exc
    core = EngineCore(EngineConfig(max_batch_size=4, cache_dir=cache),
                      model=make_tiny_model(seed=4))
    assert core.runner.fused is None and not core.runner.inplace_attention
    assert set(core.runner.kernel_paths().values()) == {"torch", "modules", "none"}
    outs, _ = asyncio.run(engine_greedy(core, [[5, 9, 13], [300, 41]], 6))
    assert outs == [hf_greedy(make_tiny_model(seed=4), p, 6) for p in ([5, 9, 13], [300, 41])]
    print("SERVED")
""")


def test_without_a_compiler_the_engine_warns_why_and_serves_on_torch(tmp_path):
    """No compiler on PATH and no prebuilt library: each slow path is a WARNING naming the
    reason, and the answers are the plain model's."""
    import os

    env = {**os.environ, "PATH": str(tmp_path / "empty-bin"), "CC": ""}
    proc = subprocess.run([sys.executable, "-c", NO_COMPILER, str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=600, env=env,
                          cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0 and "SERVED" in proc.stdout, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert any("decode steps run through the model's modules" in w for w in warnings)
    assert any("prefill attention run through the model's SDPA" in w
               and "no C compiler" in w for w in warnings), warnings


def test_an_in_place_step_reads_every_row_slots_where_their_tables_put_them():
    import random

    import torch

    from app.attention import PagedDecodeStep
    from app.config import EngineConfig
    from app.model_runner import ModelRunner
    from tests.conftest import make_tiny_model

    cache = ModelRunner(make_tiny_model(), EngineConfig()).make_kv_cache(64, 16)
    rng = random.Random(3)
    blocks = list(range(64))
    rng.shuffle(blocks)
    positions = [0, 15, 16, 31, 100, 47]  # a block's first and last slots, several blocks
    tables = []
    for pos in positions:
        need = pos // 16 + 1 + rng.randrange(2)  # some tables hold a spare block
        tables.append([blocks.pop() for _ in range(need)])
    step = PagedDecodeStep.build(cache, tables, positions, inplace=True)
    per_row = [[t[j // 16] * 16 + j % 16 for j in range(p + 1)]  # position j's slot
               for t, p in zip(tables, positions, strict=True)]
    (read,), (write,) = step.read_slots.values(), step.write_slots.values()
    assert read.tolist() == [slot for row in per_row for slot in row]
    assert write.tolist() == [row[-1] for row in per_row]
    assert cache.slot_index(tables[4], 101).tolist() == per_row[4]
    assert step.offsets.tolist() == [0, *torch.cumsum(torch.tensor(
        [p + 1 for p in positions]), 0).tolist()]
    assert read.dtype == write.dtype == step.offsets.dtype == torch.long
    with pytest.raises(IndexError, match="need 2 blocks"):
        PagedDecodeStep.build(cache, [[0], [1]], [3, 16], inplace=True)
    with pytest.raises(IndexError, match="outside the pool"):
        PagedDecodeStep.build(cache, [[0], [64]], [3, 5], inplace=True)
