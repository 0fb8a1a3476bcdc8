"""`tiller env [--json] [--no-measure]`: what a bug report needs, and what decides speed on this machine.

Prints versions (tiller, python, torch, transformers, vllm, ray, peft, trl), the OS, the CPU (model, the
ISA torch dispatches, the flags that matter), cores and torch threads, measured fp32 / bf16 GEMM rates at
1 thread and at torch's thread count, the bf16 decision with its reason, free memory and disk, and CUDA
devices. `--json` prints the same facts as one JSON object (`tiller.hostinfo.host_facts()`; stable
snake_case keys). Takes ~1-3 s, most of it importing torch and timing GEMMs.
"""

from __future__ import annotations

import argparse
import json

from tiller.hostinfo import PACKAGES, host_facts


def _rate(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.1f} GFLOP/s"


def gpu_path(facts: dict) -> str:
    """What the native engine and the update do on this machine's GPU, from `host_facts()` (the `gpu path` line)."""
    triton = facts["triton_version"]
    decode = (f"decode (by default) in CUDA graphs of Inductor-compiled layers (Triton {triton})" if triton else
              "decode (by default) in CUDA graphs of eager layers (Triton not installed: `pip install triton` "
              "compiles them)")
    packed = ("torch's varlen attention (packed update and prefill)" if facts["varlen_attention"] else
              "no torch varlen attention (this torch predates it: padded prefill, per-row packed attention)")
    return f"torch CUDA {facts['torch_cuda']}; {decode}; {packed}"


def format_facts(facts: dict) -> str:
    """The plain-text report of `host_facts()`: one `name  value` line per fact."""
    rows: list[tuple[str, str]] = []
    for name in PACKAGES:
        version = facts[f"{name}_version"]
        if name == "vllm" and version is not None:
            version = f"{version} ({facts['vllm_distribution']})"
        rows.append((name, version or "not installed"))
    rows.append(("python", facts["python_version"]))
    rows.append(("os", facts["os"]))
    rows.append(("cpu", f"{facts['cpu_model'] or 'unknown model'} ({facts['machine']})"))
    rows.append(("host kind", facts["host_kind"]))
    rows.append(("torch cpu isa", f"{facts['cpu_capability']} (torch.backends.cpu.get_cpu_capability())"))
    flags = facts["cpu_flags"]
    rows.append(("cpu flags", "could not be read" if flags is None else " ".join(flags) or "none of interest"))
    usable = "" if facts["usable_cores"] is None else f", {facts['usable_cores']} usable"
    rows.append(("cores", f"{facts['logical_cores']} logical{usable}; torch threads {facts['torch_threads']}"))
    threads = facts["torch_threads"]
    if facts["gemm_n"] is not None:
        n, bf16_n = facts["gemm_n"], facts["gemm_bf16_n"]
        rows.append(("gemm fp32", f"{_rate(facts['gemm_fp32_gflops_1thread'])} (1 thread), "
                                  f"{_rate(facts['gemm_fp32_gflops'])} ({threads} threads); {n}x{n}"))
        small = "" if bf16_n == n else ", small: no usable bf16 here"
        rows.append(("gemm bf16", f"{_rate(facts['gemm_bf16_gflops_1thread'])} (1 thread), "
                                  f"{_rate(facts['gemm_bf16_gflops'])} ({threads} threads); {bf16_n}x{bf16_n}{small}"))
    else:
        rows.append(("gemm", "not measured (--no-measure)"))
    rows.append(("bf16 compute", f"{'on' if facts['bf16_decision'] else 'off'}: {facts['bf16_reason']}"))
    total = "" if facts["mem_total_gb"] is None else f" of {facts['mem_total_gb']:.1f} GiB"
    available = "unknown" if facts["mem_available_gb"] is None else f"{facts['mem_available_gb']:.1f} GiB"
    rows.append(("memory", f"{available} available{total}"))
    rows.append(("disk", f"{facts['disk_free_gb']:.1f} GiB free in the current directory"))
    cuda = facts["cuda_devices"]
    rows.append(("cuda", "; ".join(f"{d['index']}: {d['name']} {d['memory_gb']:.0f} GiB (sm {d['capability']})"
                                   for d in cuda) or "none"))
    if cuda:
        rows.append(("gpu path", gpu_path(facts)))
    env = facts["speed_env"]
    rows.append(("env", " ".join(f"{k}={v}" for k, v in env.items()) or "no speed-related variables set"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tiller env", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--no-measure", action="store_true", help="skip the GEMM timings (~1-2 s)")
    args = parser.parse_args(argv)
    facts = host_facts(measure=not args.no_measure)
    print(json.dumps(facts) if args.json else format_facts(facts))
    return 0
