"""The engine's own CPU kernels (``app/csrc/``), built on first use: the matrix kernel of
every linear layer (``panel_gemm.c``), decode attention over the paged KV pool
(``paged_attention.c``) and a Llama-style model's whole decode step over both
(``decode_step.c``, ``app.fused_decode``).

A decode step is a few hundred products of a handful of rows against weights that come from
memory. MKL's GEMV streams this model's narrow weights well below the rate of one long GEMV,
and its sgemm's time grows with the rows, so a batch of streams paid for the weights several
times over. The kernel in ``csrc/panel_gemm.c`` reads each weight once per product whatever
the batch (see that file's header for the layout and threading); its step times against MKL's
and oneDNN's are in BENCHMARKS.md §1, "The fused decode step and the kernels behind it".

The decode attention reads each row's keys and values in place from its blocks
(``app.attention``), where torch needed a gathered copy and an SDPA call per layer.

The panels may hold float32, bf16 or int8 weights (``panel_body.h``, compiled once per
kind, widens them to float32 in registers), and on a CPU with AVX512-BF16 bf16 panels in
pairs of k go through its bf16 dot product (``panel_bf16dp.c``), which shortens both prefill
and decode steps (BENCHMARKS.md §1, "bf16 and int8 weights").

They are plain C with AVX2 and FMA intrinsics. The panel kernel also has AVX-512 tiles, chosen
at run time where the CPU has AVX-512: products of four rows or more, a prefill's included,
run faster there (BENCHMARKS.md §1), bit for bit the same. Prefill attention
(``prefill_attention.c``) takes the same choice: zmm where the CPU has AVX-512, else the
same panels and blocks in ymm halves. ``SPLITSERVE_KERNEL_ISA=avx2`` keeps every kernel to
its AVX2 path (``panel_limit_avx2``), as on a CPU without AVX-512, for the tests and for
measuring an AVX2-only CPU's paths here.
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
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# torch first: it loads its own libgomp.so.1, which the kernel's DT_NEEDED then resolves to,
# so the kernel's OpenMP team is torch's thread pool
import torch

from app.config import KERNEL_ISA_ENV, cpu_flags, default_cache_dir, kernel_isa

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("panel_gemm.c", "panel_bf16dp.c", "panel_i8dp.c",
                                          "paged_attention.c", "decode_step.c",
                                          "prefill_layer.c", "prefill_attention.c",
                                          "prefill_attention_bf16.c"))
HEADER = _CSRC / "kernels.h"  # every exported function: the bindings are read from it
HEADERS = (HEADER, *(_CSRC / name for name in ("vec_math.h", "layer_ops.h",
                                                 "panel_body.h", "panel_body512.h")))
# the instructions the build targets (-m...): what a CPU needs to load the library at all;
# AVX-512, AVX512-BF16 and VNNI paths are chosen at run time by the CPU's own flags
# -falign-functions=64: every kernel starts on a cache line, so its inner loops sit where
# they sat in the build that was measured whatever code is added before them (an unrelated
# change moved the 8 x 3 bf16 tile 48 bytes and made a Qwen-shaped batch-8 step 8% slower)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         "-falign-functions=64",
         # extra flags for a checking build (make test-kernels-asan); part of the name
         *os.environ.get("SPLITSERVE_KERNEL_CFLAGS", "").split())
BUILD_TIMEOUT_S = 300.0

# the kinds of weight a panel holds, as panel_gemm.c numbers them (panel_linear_w's wtype)
# (bfloat16dp: bf16 panels in pairs of k for the CPU's bf16 dot product, panel_bf16dp.c;
# int8dp: int8 panels in pairs for its 16-bit integer dot product, panel_i8dp.c)
WTYPES = {"float32": 0, "bfloat16": 1, "int8": 2, "bfloat16dp": 3, "int8dp": 4}
I8_GROUP_SHIFT = 8  # kernels.h: a group of k rides in a wtype's upper bits
I8_OFFSETS = 0x80  # kernels.h: and an offset per group, this bit
I8_HALF = 0x40  # kernels.h: the group's scales (and offsets) in float16, this one


def wtype_code(weights: str, group: int = 0, offsets: bool = False, half: bool = False) -> int:
    """panel_linear_w's wtype for panels of ``weights`` (a WTYPES kind), int8dp's with a
    scale per ``group`` of k (0: per output), an offset per group where ``offsets``, those
    in float16 where ``half``. Raises ``ValueError`` for a kind it lacks, a group on another
    kind, offsets or half without a group."""
    if weights not in WTYPES:
        raise ValueError(f"weights must be one of {sorted(WTYPES)}, got {weights!r}")
    if group and weights != "int8dp":
        raise ValueError(f"a scale per group of k needs int8dp panels, not {weights}")
    if (offsets or half) and not group:
        raise ValueError("offsets and float16 scales need a group of k")
    return (WTYPES[weights] | (group << I8_GROUP_SHIFT) | (I8_OFFSETS if offsets else 0)
            | (I8_HALF if half else 0))

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failure: tuple[str, str] | None = None  # (the compiler's identity then, why)


class KernelError(ValueError):
    """A kernel refused its arguments (``status``, kernels.h's ``sk_status``): the message
    names the entry point and the argument at fault."""

    def __init__(self, entry: str, status: int, meaning: str) -> None:
        super().__init__(f"{entry} refused its arguments ({status}): {meaning}")
        self.entry, self.status = entry, status


def check(status: int, entry: str) -> None:
    """Raise :class:`KernelError` for a status other than 0 from kernel ``entry``."""
    if status != 0:
        assert _lib is not None
        raise KernelError(entry, status, _lib.sk_status_message(status).decode())


def assert_kernel_tensors(**tensors: tuple[torch.Tensor, torch.dtype]) -> None:
    """Before a pointer is taken: each ``name=(tensor, dtype)`` is on the CPU, of that
    dtype and contiguous (AssertionError naming the argument otherwise)."""
    for name, (tensor, dtype) in tensors.items():
        assert tensor.device.type == "cpu", f"{name}: on {tensor.device}, not the CPU"
        assert tensor.dtype == dtype, f"{name}: {tensor.dtype}, not {dtype}"
        assert tensor.is_contiguous(), f"{name}: not contiguous"


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


def compiler_identity(compiler: str | None) -> str:
    """The compiler's name and version (its ``--version`` first line), or ``none``."""
    if compiler is None:
        return "none"
    try:
        proc = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=30)
        first = (proc.stdout or proc.stderr).strip().splitlines()
        return f"{compiler}: {first[0] if first else 'unknown version'}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{compiler}: {exc}"


def _source_digest() -> str:
    return hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS)
                          + " ".join(FLAGS).encode()).hexdigest()[:16]


def library_path(cache_dir: Path, identity: str | None = None) -> Path:
    """Where the library built from these sources and flags by the compiler ``identity``
    (default: the one on PATH now) lives: a new compiler or version builds its own."""
    identity = compiler_identity(_compiler()) if identity is None else identity
    tag = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return cache_dir / "kernels" / f"splitserve-cpu-{_source_digest()}-{tag}.so"


def choose_library(cache_dir: Path, identity: str) -> tuple[Path, bool]:
    """(the library to load, whether it must be built first). The compiler's own build where
    it exists; with no compiler, any build of these sources (an image's prebuilt one)."""
    target = library_path(cache_dir, identity)
    if target.exists() or identity != "none":
        return target, not target.exists()
    built = sorted(target.parent.glob(f"splitserve-cpu-{_source_digest()}-*.so"))
    if not built:
        raise RuntimeError("no C compiler (set CC, or install cc/gcc/clang) and no library "
                           f"of these sources prebuilt in {target.parent}")
    return built[0], False


def openmp_mismatch(library: Path) -> str | None:
    """Why ``library`` would bring a second OpenMP runtime into the process (it must link
    torch's libgomp.so.1, as gcc's -fopenmp does; clang's libomp or Intel's iomp would run a
    second thread pool against torch's), or None."""
    data = library.read_bytes()
    for other in (b"libomp.so", b"libiomp5.so"):
        if other in data:
            return f"{library.name} links {other.decode()}, not torch's libgomp.so.1"
    if b"libgomp.so.1" not in data:
        return f"{library.name} does not link libgomp.so.1 (torch's OpenMP runtime)"
    return None


def _build(target: Path, compiler: str | None) -> None:
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
        reason = openmp_mismatch(Path(tmp))
        if reason is not None:
            raise RuntimeError(f"refused the build: {reason} (build with gcc: CC=gcc)")
        os.replace(tmp, target)  # atomic: replicas building at once each load a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_CTYPES = {"long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float}


def _ctype(decl: str, result: bool = False) -> object:
    """The ctypes type of a declaration's type (``result``: a return type)."""
    if "*" in decl:
        return ctypes.c_char_p if result and "char" in decl else ctypes.c_void_p
    words = decl.replace("const", " ").split()
    if result:
        return None if words == ["void"] else _CTYPES[words[-1]]
    return _CTYPES[words[0]]


def declarations(text: str) -> dict[str, tuple[object, list[object]]]:
    """kernels.h's functions: name -> (ctypes restype, argtypes). Pointers are addresses."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    out: dict[str, tuple[object, list[object]]] = {}
    for ret, name, args in re.findall(r"([A-Za-z_][\w\s\*]*?)\b(\w+)\s*\(([^()]*)\)\s*;",
                                      text):
        params = [a.strip() for a in args.split(",") if a.strip() not in ("", "void")]
        out[name] = (_ctype(ret.strip(), result=True), [_ctype(a) for a in params])
    return out


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in declarations(HEADER.read_text()).items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def load_kernel(cache_dir: Path | None = None) -> ctypes.CDLL:
    """The built kernel library (built on first call in this process; later calls return
    it, whatever their ``cache_dir``: one library a process, the same sources). Raises
    ``RuntimeError`` saying why it cannot be had; a failure is remembered until the
    compiler on PATH changes."""
    global _lib, _failure
    with _lock:
        if _lib is not None:
            return _lib
        isa = kernel_isa()  # a bad $SPLITSERVE_KERNEL_ISA raises, not a quiet fallback
        compiler = _compiler()
        identity = compiler_identity(compiler)
        if _failure is not None and _failure[0] == identity:
            raise RuntimeError(_failure[1])
        try:
            reason = cpu_unsupported()
            if reason is not None:
                raise RuntimeError(reason)
            target, build = choose_library(Path(cache_dir or default_cache_dir()), identity)
            if build:
                logger.info("building the CPU kernels into %s (%s)", target, identity)
                start = time.perf_counter()
                _build(target, compiler)
                logger.info("built the CPU kernels in %.1f s (once per machine: a restarted "
                            "replica loads them from there)", time.perf_counter() - start)
            reason = openmp_mismatch(target)
            if reason is not None:
                raise RuntimeError(f"refused {target}: {reason}")
            _lib = _bind(ctypes.CDLL(str(target)))
            if isa == "avx2":
                _lib.panel_limit_avx2(1)
                logger.info("CPU kernels kept to AVX2 and FMA (%s=avx2): no AVX-512 tiles, "
                            "bf16 or VNNI dot products", KERNEL_ISA_ENV)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            _failure = (identity, f"CPU kernels unavailable: {exc}")
            raise RuntimeError(_failure[1]) from exc
        return _lib


def vector_path(cache_dir: Path | None = None) -> str:
    """The widest vectors the kernels take on this CPU: ``avx512`` (its tiles, and the bf16
    and VNNI dot products where it has them), ``avx2``, ``avx2_kept`` (kept to AVX2 on a CPU
    with more: ``SPLITSERVE_KERNEL_ISA=avx2``) or ``none`` (no kernels here)."""
    if kernel_unavailable(cache_dir) is not None:
        return "none"
    lib = load_kernel(cache_dir)
    if lib.panel_avx2_only():
        return "avx2_kept"
    return "avx512" if lib.panel_has_avx512() else "avx2"


def kernel_unavailable(cache_dir: Path | None = None) -> str | None:
    """Why the kernels cannot be used here, or None when they load."""
    try:
        load_kernel(cache_dir)
    except RuntimeError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m app.cpu_kernels [--cache-dir DIR]``: build (or find) the library now, as
    an image build does, and say where it is and which compiler built it."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="default: $SPLITSERVE_CACHE or ~/.cache/splitserve")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        lib = load_kernel(args.cache_dir)
    except RuntimeError as exc:
        print(exc)
        return 1
    print(f"{lib._name} ({compiler_identity(_compiler())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
