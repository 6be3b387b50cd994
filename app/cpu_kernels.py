"""The engine's own CPU kernels (``app/csrc/``), built on first use: the matrix kernel of
every linear layer (``panel_gemm.c``), decode attention over the paged KV pool
(``paged_attention.c``) and a Llama-style model's whole decode step over both
(``decode_step.c``, ``app.fused_decode``).

A decode step is a few hundred products of a handful of rows against weights that come from
memory. MKL's GEMV streams this model's 576-wide weights at about half the rate one long GEMV
does, and its sgemm at 8 rows costs about 3x its one-row time, so a batch of streams paid for
the weights several times over. The kernel in ``csrc/panel_gemm.c`` reads each weight once per
product whatever the batch (see that file's header for the layout and threading). Measured
here (2026-12-02, SmolLM2-135M, the 30 layers' linears, weights from memory), one thread:
39 ms at 1 row, 46-50 ms at 8 rows against MKL's 52-55 / 98 ms and oneDNN's 61-71 / 86-94;
two threads: 23 / 33 ms against oneDNN's 58 / 70.

The decode attention reads each row's keys and values in place from its blocks
(``app.paged_attention``), where torch needed a gathered copy per layer and an SDPA call that
costs about 0.35 ms for 8 rows of 64 positions.

The panels may hold float32, bf16 or int8 weights (``panel_body.h``, compiled once per
kind, widens them to float32 in registers), and on a CPU with AVX512-BF16 bf16 panels in
pairs of k go through its bf16 dot product (``panel_bf16dp.c``): SmolLM2's 1,024-token
prefill 2.9 -> 1.9 s and a batch-1 decode step 22 -> 12 ms on one Zen 5 core.

They are plain C with AVX2 and FMA intrinsics. The panel kernel also has AVX-512 tiles, chosen
at run time where the CPU has AVX-512: products of four rows or more, a prefill's included,
run about 1.5-1.9x faster on a Zen 5 core, bit for bit the same. Prefill attention
(``prefill_attention.c``) takes the same choice: zmm where the CPU has AVX-512, else the
same panels and blocks in ymm halves.
They are compiled here with the machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``) into ``<cache_dir>/kernels/`` under a name that
hashes the source and flags, so a replica that restarts loads the built library. Where the
CPU lacks AVX2/FMA, there is no compiler, or the build fails, :func:`kernel_unavailable` says
why and the engine keeps oneDNN's packed layout (``app.packed_linear``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# torch first: it loads its own libgomp.so.1, which the kernel's DT_NEEDED then resolves to,
# so the kernel's OpenMP team is torch's thread pool
import torch

from app.config import cpu_flags, default_cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("panel_gemm.c", "panel_bf16dp.c", "panel_i8dp.c",
                                          "paged_attention.c", "decode_step.c",
                                          "prefill_attention.c"))
HEADERS = tuple(_CSRC / name for name in ("vec_math.h", "panel_body.h", "panel_body512.h"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
BUILD_TIMEOUT_S = 300.0

# the kinds of weight a panel holds, as panel_gemm.c numbers them (panel_linear_w's wtype)
# (bfloat16dp: bf16 panels in pairs of k for the CPU's bf16 dot product, panel_bf16dp.c;
# int8dp: int8 panels in pairs for its 16-bit integer dot product, panel_i8dp.c)
WTYPES = {"float32": 0, "bfloat16": 1, "int8": 2, "bfloat16dp": 3, "int8dp": 4}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failure: str | None = None


def cpu_unsupported() -> str | None:
    """Why this CPU cannot run the kernel (it needs x86-64 with AVX2 and FMA), or None."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"the kernel needs an x86-64 CPU, this one is {machine or 'unknown'}"
    flags = cpu_flags()
    if flags is None:
        capability = torch.backends.cpu.get_cpu_capability()
        return None if capability in ("AVX2", "AVX512") else f"no AVX2 (torch: {capability})"
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"the CPU lacks {' and '.join(missing)}" if missing else None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def library_path(cache_dir: Path) -> Path:
    digest = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)
                            + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir / "kernels" / f"splitserve-cpu-{digest}.so"


def _build(target: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc/clang)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: replicas building at once each load a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, size = ctypes.c_void_p, ctypes.c_long
    lib.panel_nr.restype = size
    lib.panel_nr.argtypes = []
    lib.panel_floats.restype = size
    lib.panel_floats.argtypes = [size, size]
    lib.panel_pack.restype = None
    lib.panel_pack.argtypes = [ptr, size, size, size, ptr]
    lib.panel_has_avx512bf16.restype = ctypes.c_int
    lib.panel_has_avx512bf16.argtypes = []
    lib.panel_pair_elems.restype = size
    lib.panel_pair_elems.argtypes = [size, size]
    lib.panel_pack_pairs.restype = None
    lib.panel_pack_pairs.argtypes = [ptr, size, size, size, ptr]
    lib.panel_has_avx512vnni.restype = ctypes.c_int
    lib.panel_has_avx512vnni.argtypes = []
    lib.panel_pack_pairs_i8.restype = None
    lib.panel_pack_pairs_i8.argtypes = [ptr, size, size, size, ptr]
    lib.panel_pack_bytes.restype = ctypes.c_int
    lib.panel_pack_bytes.argtypes = [ptr, size, size, size, ptr, size]
    lib.panel_has_avx512.restype = ctypes.c_int
    lib.panel_has_avx512.argtypes = []
    lib.panel_set_avx512.restype = ctypes.c_int
    lib.panel_set_avx512.argtypes = [ctypes.c_int]
    lib.panel_uses_avx512.restype = ctypes.c_int
    lib.panel_uses_avx512.argtypes = []
    lib.panel_linear.restype = None
    lib.panel_linear.argtypes = [ptr, size, size, ptr, size, ptr, ptr, ctypes.c_int]
    lib.panel_linear_w.restype = ctypes.c_int
    lib.panel_linear_w.argtypes = [ptr, size, size, ptr, ctypes.c_int, ptr, size, ptr, ptr,
                                   ctypes.c_int]
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, size, size, size, ptr, ptr, size,
                                           ctypes.c_float, ptr, ctypes.c_int]
    lib.prefill_attention.restype = ctypes.c_int
    lib.prefill_attention.argtypes = [*([ptr, size, size, size] * 4), size, size, size, size, size,
                                      size, ptr, size, ctypes.c_float, ctypes.c_int]
    lib.decode_step_layer_ptrs.restype = size
    lib.decode_step_layer_ptrs.argtypes = []
    lib.decode_step.restype = ctypes.c_int
    lib.decode_step.argtypes = [ptr, size, size, ptr, size, size, size, size, size, ptr, ptr,
                                ctypes.c_float, ctypes.c_float, ptr, ptr, ptr, ptr, ptr, ptr,
                                size, ptr, ctypes.c_int, ctypes.c_int, ptr]
    return lib


def load_kernel(cache_dir: Path | None = None) -> ctypes.CDLL:
    """The built kernel library (built on first call in this process; later calls return
    it). Raises ``RuntimeError`` saying why it cannot be had."""
    global _lib, _failure
    with _lock:
        if _lib is not None:
            return _lib
        if _failure is not None:
            raise RuntimeError(_failure)
        try:
            reason = cpu_unsupported()
            if reason is not None:
                raise RuntimeError(reason)
            target = library_path(cache_dir or default_cache_dir())
            if not target.exists():
                logger.info("building the CPU kernels into %s", target)
                start = time.perf_counter()
                _build(target)
                logger.info("built the CPU kernels in %.1f s (once per machine: a restarted "
                            "replica loads them from there)", time.perf_counter() - start)
            _lib = _bind(ctypes.CDLL(str(target)))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            _failure = f"CPU kernels unavailable: {exc}"
            raise RuntimeError(_failure) from exc
        return _lib


def kernel_unavailable(cache_dir: Path | None = None) -> str | None:
    """Why the kernels cannot be used here, or None when they load."""
    try:
        load_kernel(cache_dir)
    except RuntimeError as exc:
        return str(exc)
    return None
