"""A C kernel for the native engine's one-token attention on CPU (`kernels/decode_attention.c`).

At decode time each row's query attends over its cached keys / values. PyTorch's CPU SDPA runs that as a
blocked flash-attention with a small GEMM call per (row, head, key block); with one query token those calls
are mostly overhead, and the step reads the cache at a fraction of the memory bandwidth. The kernel here
reads each row's keys and values once for all query heads of a kv head (grouped-query attention), keeps the
queries and the output accumulator in vector registers, and runs the softmax with a vectorised exp. A row starts at
its first unmasked column (a right-aligned prompt's padding is never read), and the values, then the next head's
keys, are prefetched while the keys, then the values, stream: the cache is read from memory every step (it is far
larger than the caches) and short streams otherwise wait on DRAM latency.

It is compiled on first use for the model's (query group, head dim) with the C compiler on PATH (`CC`, else
gcc / cc / clang) and `-O3 -march=native -ffast-math`, into `$TILLER_CACHE/kernels` (default
`~/.cache/tiller/kernels`), named by a hash of the source, the flags, the compiler and the CPU's flags, so a
home directory shared by different machines never loads another CPU's build; written atomically. No compiler,
a failed build, a head dim that is not a multiple of 16, or a dtype other than fp32 / bf16: `attention_kernel`
returns None and the engine keeps SDPA (a failed build warns once). `TILLER_DECODE_KERNEL=0` turns it off.

Results equal SDPA's up to summation order and exp's last bits (~1e-6 relative in fp32). Rows are split over
`torch.get_num_threads()` threads (ctypes releases the GIL during the call).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tiller.cache import cache_dir

_SOURCE = Path(__file__).with_name("kernels") / "decode_attention.c"
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-Wno-psabi")
# linked in a second command without -ffast-math: with it, GCC / clang link crtfastmath.o into the library,
# whose constructor turns on flush-to-zero / denormals-are-zero in the loading thread, changing every later
# float computation of that thread (training included)
_LINK = ("-shared",)
_LOCK = threading.Lock()
_LIBS: dict[tuple[int, int], ctypes.CDLL | None] = {}
_POOLS: dict[int, ThreadPoolExecutor] = {}  # by worker count
_NEG = -3.0e38  # the kernel's "masked": finite, as -ffast-math assumes
_I64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p, _I64, _I64, _I64, ctypes.c_void_p, _I64, _I64, _I64, ctypes.c_void_p, _I64, _I64, _I64,
             ctypes.c_void_p, _I64, ctypes.c_void_p, ctypes.c_void_p, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
             ctypes.c_float, ctypes.c_void_p]


def compiler() -> str | None:
    """The C compiler the kernel is built with: `$CC`, else gcc, cc or clang on PATH; None without one."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("gcc", "cc", "clang")) if p), None)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compile_library(source: Path, defines: tuple[str, ...], stem: str, what: str,
                    fallback: str) -> ctypes.CDLL | None:
    """`source` compiled with `defines` into `$TILLER_CACHE/kernels/<stem>_<hash>.so` (built once per source, flags,
    compiler and CPU; written atomically) and loaded; None without a C compiler, off Linux / macOS, or when the build
    fails (a warning naming `what` and the `fallback` taken)."""
    cc = compiler()
    if cc is None or platform.system() not in ("Linux", "Darwin"):
        return None
    text = source.read_text()
    key = hashlib.sha1("\n".join([text, *_FLAGS, *_LINK, *defines, cc, platform.machine(), _cpu_flags()]).encode())
    out = cache_dir("kernels") / f"{stem}_{key.hexdigest()[:12]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        obj = tmp[:-3] + ".o"
        link = [cc, *_LINK, "-o", tmp, obj, "-lm"]
        if platform.system() == "Linux":
            link.append("-lmvec")  # glibc's vector math (the vectorised expf under -ffast-math)
        try:
            for cmd in ([cc, *_FLAGS, *defines, "-c", "-o", obj, str(source)], link):
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                if proc.returncode != 0:
                    break
            if proc.returncode != 0:
                warnings.warn(f"tiller: building {what} failed ({' '.join(cmd)}): {proc.stderr.strip()[-500:]}; "
                              f"{fallback}", stacklevel=4)
                return None
            os.replace(tmp, out)
        except (OSError, subprocess.TimeoutExpired) as err:
            warnings.warn(f"tiller: building {what} failed: {err}; {fallback}", stacklevel=4)
            return None
        finally:
            for path in (tmp, obj):
                if os.path.exists(path):
                    os.unlink(path)
    return ctypes.CDLL(str(out))


def _build(group: int, head_dim: int) -> ctypes.CDLL | None:
    lib = compile_library(_SOURCE, (f"-DKG={group}", f"-DKD={head_dim}"), f"decode_attention_g{group}_d{head_dim}",
                          "the decode-attention kernel", "decoding with SDPA")
    if lib is not None:
        for name in ("decode_attention_f32", "decode_attention_bf16"):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = None, _ARGTYPES
    return lib


def _library(group: int, head_dim: int) -> ctypes.CDLL | None:
    with _LOCK:
        if (group, head_dim) not in _LIBS:
            _LIBS[(group, head_dim)] = _build(group, head_dim)
        return _LIBS[(group, head_dim)]


class DecodeAttention:
    """`(q [B, Hk, G, D], k / v [B, Hk, L, D], mask) -> [B, Hk, G, D]` for one model's shapes, on CPU.

    k / v may be views (the engine's cache columns) as long as the head dim is contiguous; the mask is the
    engine's SDPA mask `[B, 1, 1, L]`, bool (True = attend) or additive float. The mask converted for the
    kernel, and each row's first unmasked column (the kernel reads no key / value before it), are kept while the
    same mask object comes back (every layer of a step passes the same one)."""

    def __init__(self, lib: ctypes.CDLL, group: int, head_dim: int, scaling: float):
        self.lib, self.group, self.head_dim, self.scaling = lib, group, head_dim, float(scaling)
        # (the engine's mask, the kernel's [B, L] float mask, the first unmasked column of each row [B] int64)
        self._cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _mask2d(self, mask: torch.Tensor | None, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        cached = self._cached  # one read: another thread may replace it (a tuple assignment is atomic)
        if mask is not None and cached is not None and cached[0] is mask:
            return cached[1], cached[2]
        if mask is None:
            return torch.zeros(b, length), None
        if mask.dtype == torch.bool:
            m = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, _NEG)
        else:
            m = mask.float().clamp_min(_NEG)
        m = m.expand(b, 1, 1, length).reshape(b, length).contiguous()
        # argmax returns the first maximum: the first column above "masked" (0 for a row masked everywhere)
        start = (m > _NEG / 2).to(torch.uint8).argmax(-1).contiguous()
        self._cached = (mask, m, start)
        return m, start

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, hk, g, d = q.shape
        length = k.shape[2]
        # the library is built for one (group, head dim) and reads raw memory: anything else is refused here
        if (g, d) != (self.group, self.head_dim) or k.shape != (b, hk, length, d) or v.shape != k.shape:
            raise ValueError(f"decode attention built for group {self.group} / head dim {self.head_dim}: got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.bfloat16)) or \
                {q.device.type, k.device.type, v.device.type} != {"cpu"}:
            raise ValueError(f"decode attention: q / k / v must be fp32 or bf16 CPU tensors of one dtype, got "
                             f"{q.dtype} / {k.dtype} / {v.dtype}")
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the head dim must be dense
        m, start = self._mask2d(mask, b, length)
        out = torch.empty((b, hk, g, d), dtype=q.dtype)
        fn = self.lib.decode_attention_f32 if q.dtype == torch.float32 else self.lib.decode_attention_bf16
        threads = max(1, min(torch.get_num_threads(), b))
        scratch = torch.empty((threads, g * length), dtype=torch.float32)
        common = (q.data_ptr(), *q.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
                  m.data_ptr(), m.stride(0), None if start is None else start.data_ptr(), out.data_ptr(),
                  *out.stride()[:3])

        def run(i: int) -> None:
            fn(*common, b * i // threads, b * (i + 1) // threads, hk, length, self.scaling, scratch[i].data_ptr())

        run_parts(run, threads)
        return out


def run_parts(run, threads: int) -> None:
    """`run(i)` for i in range(threads): part 0 on the calling thread, the others on a shared pool (kernels called
    through ctypes release the GIL)."""
    if threads == 1:
        run(0)
        return
    pool = _POOLS.get(threads - 1)
    if pool is None:
        pool = _POOLS.setdefault(threads - 1, ThreadPoolExecutor(threads - 1, thread_name_prefix="tiller-kernel"))
    futures = [pool.submit(run, i) for i in range(1, threads)]
    run(0)
    for f in futures:
        f.result()


def attention_kernel(n_q: int, n_kv: int, head_dim: int, scaling: float, device: torch.device,
                     dtype: torch.dtype) -> DecodeAttention | None:
    """The kernel for a model with these heads on `device` in `dtype`, or None where it does not apply (not
    CPU, a dtype other than fp32 / bf16, a head dim not a multiple of 16, no C compiler, a failed build,
    `TILLER_DECODE_KERNEL=0` in the environment)."""
    if os.environ.get("TILLER_DECODE_KERNEL", "1") == "0":  # the user's switch back to SDPA
        return None
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if head_dim % 16 or n_q % n_kv:
        return None
    lib = _library(n_q // n_kv, head_dim)
    return None if lib is None else DecodeAttention(lib, n_q // n_kv, head_dim, scaling)
