"""The bf16 decision (features first, a timing to confirm), the fallbacks that follow it, and `tiller env`."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

import tiller.hostinfo as hostinfo
from tiller.hostinfo import Bf16Decision, bf16_decision, gemm_gflops, host_kind, parse_cpuinfo


def features(machine="x86_64", cap="AVX512", flags=("avx", "avx2", "fma", "avx512f")):
    return {"machine": machine, "system": "Linux", "cpu_model": "Test CPU", "aten_capability": cap,
            "flags": None if flags is None else frozenset(flags)}


AVX2 = features(cap="AVX2", flags=("avx", "avx2", "fma"))
AVX512_BF16 = features(flags=("avx2", "avx512f", "avx512_bf16"))
AMX = features(flags=("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))
ARM_BF16 = features(machine="arm64", cap="DEFAULT", flags=("asimd", "bf16"))
ARM_NO_BF16 = features(machine="arm64", cap="DEFAULT", flags=("asimd",))


class FakeTiming:
    """Returns fixed (fp32, bf16) GFLOP/s and counts its calls."""

    def __init__(self, fp32: float, bf16: float):
        self.rates, self.calls = (fp32, bf16), 0

    def __call__(self):
        self.calls += 1
        return self.rates


@pytest.fixture
def decision(monkeypatch):
    """Set this process's cached decision (and forget earlier fallback warnings) for one test."""
    monkeypatch.setattr(hostinfo, "_WARNED_KEYS", set())

    def set_(use_bf16: bool, reason: str = "test host says so") -> Bf16Decision:
        d = Bf16Decision(use_bf16, reason)
        monkeypatch.setattr(hostinfo, "_DECISION", d)
        return d

    return set_


# ------------------------------------------------------------------------------------------- decision


def test_avx2_host_says_no_without_timing():
    timing = FakeTiming(80.0, 500.0)  # even a (wrong) fast bf16 timing must not be consulted
    d = bf16_decision(AVX2, timing)
    assert not d.use_bf16 and timing.calls == 0
    assert "AVX2" in d.reason and "avx512_bf16" in d.reason and "no bf16 instructions" in d.reason
    assert d.fp32_gflops is None and d.bf16_gflops is None


def test_avx512_without_bf16_says_no_without_timing():
    timing = FakeTiming(80.0, 500.0)
    d = bf16_decision(features(flags=("avx2", "avx512f", "avx512bw")), timing)
    assert not d.use_bf16 and timing.calls == 0 and "AVX-512 without BF16" in d.reason


@pytest.mark.parametrize("host", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx"])
def test_bf16_host_with_fast_bf16_says_yes(host):
    timing = FakeTiming(80.0, 170.0)
    d = bf16_decision(host, timing)
    assert d.use_bf16 and timing.calls == 1
    assert (d.fp32_gflops, d.bf16_gflops) == (80.0, 170.0)
    assert "avx512_bf16" in d.reason and "x2.12" in d.reason  # 170 / 80 = 2.125


def test_bf16_host_with_slower_bf16_says_no():
    d = bf16_decision(AVX512_BF16, FakeTiming(80.0, 60.0))
    assert not d.use_bf16 and "slower" in d.reason and "60.0" in d.reason and "80.0" in d.reason


def test_equal_rates_pass_the_threshold():
    # BF16_MIN_SPEEDUP = 1.0: bf16 must not be slower; equal is enough
    assert bf16_decision(AVX512_BF16, FakeTiming(80.0, 80.0)).use_bf16


def test_torch_dispatching_avx2_on_a_bf16_cpu_says_no(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    timing = FakeTiming(80.0, 170.0)
    d = bf16_decision({**AVX512_BF16, "aten_capability": "AVX2"}, timing)
    assert not d.use_bf16 and timing.calls == 0
    assert "torch dispatches AVX2" in d.reason and "ATEN_CPU_CAPABILITY=avx2" in d.reason
    assert not bf16_decision({**AVX512_BF16, "aten_capability": "DEFAULT"}, timing).use_bf16
    assert timing.calls == 0


def test_arm_bf16_follows_the_timing():
    assert bf16_decision(ARM_BF16, FakeTiming(40.0, 90.0)).use_bf16
    slow = bf16_decision(ARM_BF16, FakeTiming(40.0, 10.0))
    assert not slow.use_bf16 and "ARM bf16" in slow.reason and "slower" in slow.reason


def test_arm_without_bf16_says_no_without_timing():
    timing = FakeTiming(40.0, 90.0)
    d = bf16_decision(ARM_NO_BF16, timing)
    assert not d.use_bf16 and timing.calls == 0 and "ARM" in d.reason and "bf16" in d.reason


def test_unreadable_flags_leave_it_to_the_timing():
    d = bf16_decision(features(flags=None), FakeTiming(80.0, 170.0))
    assert d.use_bf16 and "could not be read" in d.reason
    assert not bf16_decision(features(flags=None, cap="AVX2"), FakeTiming(80.0, 170.0)).use_bf16


def test_the_default_decision_is_made_once_and_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(hostinfo, "_DECISION", None)
    calls = {"features": 0}

    def fake_features():
        calls["features"] += 1
        return AVX512_BF16

    timing = FakeTiming(80.0, 170.0)
    monkeypatch.setattr(hostinfo, "cpu_features", fake_features)
    monkeypatch.setattr(hostinfo, "measure_bf16_vs_fp32", timing)
    with caplog.at_level("DEBUG", logger="tiller.hostinfo"):
        first, second = bf16_decision(), bf16_decision()
    assert first is second and first.use_bf16
    assert calls["features"] == 1 and timing.calls == 1
    assert [r.getMessage() for r in caplog.records] == [f"CPU bf16 compute on: {first.reason}"]
    assert caplog.records[0].levelname == "DEBUG"  # `tiller env` prints it; other commands do not repeat it


@pytest.mark.parametrize("host,kind", [
    (AVX2, "x86_64 AVX2 (no bf16)"),
    (AVX512_BF16, "x86_64 AVX-512 BF16"),
    (AMX, "x86_64 AMX"),
    ({**AVX512_BF16, "aten_capability": "AVX2"}, "x86_64 AVX-512 BF16 [torch AVX2]"),
    (ARM_BF16, "arm64 bf16"),
    (ARM_NO_BF16, "arm64 (no bf16)"),
])
def test_host_kind(host, kind):
    assert host_kind(host) == kind


def test_parse_cpuinfo_x86_and_arm():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9R14\n" \
          "flags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\nmodel name\t: other\n"
    assert parse_cpuinfo(x86) == ("AMD EPYC 9R14", frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"}))
    arm = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd4f\n"
    assert parse_cpuinfo(arm) == (None, frozenset({"fp", "asimd", "sve", "bf16", "i8mm"}))
    assert parse_cpuinfo("") == (None, None)


def test_cpu_features_of_this_host_are_consistent():
    f = hostinfo.cpu_features()
    assert f["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(f) == {"machine", "system", "cpu_model", "aten_capability", "flags"}
    assert f["flags"] is None or isinstance(f["flags"], frozenset)


def test_gemm_gflops_is_positive_and_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert gemm_gflops(torch.float32, 64, repeats=2) > 0
    assert torch.equal(torch.rand(3), expected)


def test_the_real_timing_runs_on_one_thread_and_restores_the_count():
    before = torch.get_num_threads()
    seen = []
    real = hostinfo.gemm_gflops

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hostinfo, "gemm_gflops", spy)
        fp32, bf16 = hostinfo.measure_bf16_vs_fp32(n=128, rounds=2)
    assert fp32 > 0 and bf16 > 0 and set(seen) == {1} and len(seen) in (2, 6)  # probe, then 2 rounds x 2
    assert torch.get_num_threads() == before


# ------------------------------------------------------------------------------------------ fallbacks


def _record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught]


def test_actor_autocast_falls_back_to_fp32_with_one_warning(decision):
    from tiller.workers.common import autocast

    decision(False, "this x86 CPU (AVX2) has no bf16 instructions")
    a = torch.randn(4, 4)

    def run():
        with autocast("bfloat16", "cpu"):
            return torch.is_autocast_enabled("cpu"), (a @ a).dtype

    (enabled, dtype), messages = _record(run)
    assert not enabled and dtype == torch.float32
    assert len(messages) == 1 and "actor_rollout_ref.actor.dtype=bfloat16" in messages[0]
    assert "float32" in messages[0] and "no bf16 instructions" in messages[0]
    (enabled, _), messages = _record(run)  # every micro-batch calls autocast: one warning per process
    assert not enabled and messages == []
    enabled, messages = _record(lambda: _enabled(autocast("bf16", "cpu", key="critic.dtype")))
    assert not enabled and len(messages) == 1 and messages[0].startswith("critic.dtype=bfloat16")


def test_actor_autocast_is_bf16_when_the_decision_says_yes(decision):
    from tiller.workers.common import autocast

    decision(True)
    a = torch.randn(4, 4)

    def run():
        with autocast("bfloat16", "cpu"):
            return torch.is_autocast_enabled("cpu"), (a @ a).dtype

    (enabled, dtype), messages = _record(run)
    assert enabled and dtype == torch.bfloat16 and messages == []
    with autocast("float32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")


def test_job_loop_autocast_follows_the_decision(decision):
    from tiller.workers.common import autocast

    decision(False, "bf16 measured slower here")
    enabled, messages = _record(lambda: _enabled(autocast("bfloat16", "cpu", key="optim.dtype")))
    assert not enabled and len(messages) == 1
    assert "optim.dtype=bfloat16" in messages[0] and "bf16 measured slower here" in messages[0]
    decision(True)
    assert _enabled(autocast("bfloat16", "cpu", key="optim.dtype"))


def _enabled(ctx) -> bool:
    with ctx:
        return torch.is_autocast_enabled("cpu")


def test_rollout_fallback_warns_with_the_reason(decision, monkeypatch):
    import tiller.rollout.base as base

    monkeypatch.setattr(base, "_BF16_FAST", {})
    decision(False, "the CPU has no avx512_bf16")
    assert not base.cpu_bf16_is_fast()
    with pytest.warns(UserWarning, match="no fast bf16 on this CPU: the CPU has no avx512_bf16; rolling out in float32"):
        assert base.effective_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert base.effective_dtype(torch.bfloat16, torch.device("cpu"), fallback=False) == torch.bfloat16
    decision(True)
    assert base.cpu_bf16_is_fast() and base.effective_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16


# ------------------------------------------------------------------------------------------ tiller env


def test_env_json_has_the_keys_with_sane_types():
    proc = subprocess.run([sys.executable, "-m", "tiller.cli", "env", "--json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["torch_version"] == torch.__version__ and isinstance(facts["tiller_version"], str)
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert isinstance(facts["host_kind"], str) and facts["host_kind"]
    assert isinstance(facts["logical_cores"], int) and facts["logical_cores"] >= 1
    assert isinstance(facts["torch_threads"], int) and facts["torch_threads"] >= 1
    for key in ("gemm_fp32_gflops", "gemm_bf16_gflops", "gemm_fp32_gflops_1thread", "gemm_bf16_gflops_1thread"):
        assert isinstance(facts[key], float) and facts[key] > 0, key
    assert isinstance(facts["bf16_decision"], bool) and isinstance(facts["bf16_reason"], str)
    assert facts["cpu_flags"] is None or all(isinstance(f, str) for f in facts["cpu_flags"])
    assert facts["mem_available_gb"] is None or facts["mem_available_gb"] > 0
    assert facts["disk_free_gb"] >= 0 and isinstance(facts["cuda_devices"], list)
    for name in ("transformers", "vllm", "ray", "peft", "trl"):
        assert facts[f"{name}_version"] is None or isinstance(facts[f"{name}_version"], str)
    assert set(hostinfo.COMPACT_KEYS) <= set(facts)


def test_env_plain_output_has_the_lines(capsys):
    from tiller.cli import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    names = [line.split("  ")[0] for line in out.splitlines()]
    assert names == ["tiller", "torch", "transformers", "vllm", "ray", "peft", "trl", "python", "os", "cpu",
                     "host kind", "torch cpu isa", "cpu flags", "cores", "gemm fp32", "gemm bf16", "bf16 compute",
                     "memory", "disk", "cuda", "env"]
    assert ["torch", torch.__version__] in [line.split() for line in out.splitlines()]
    assert bf16_decision().reason in out and "GFLOP/s (1 thread)" in out


def test_env_names_the_gpu_path_where_there_is_a_gpu():
    """With a CUDA device `tiller env` says what decides the GPU path (torch's CUDA, Triton, varlen attention);
    without one it prints no such line."""
    from tiller.env_cli import format_facts

    facts = hostinfo.host_facts(measure=False)
    assert facts["torch_cuda"] == torch.version.cuda and isinstance(facts["varlen_attention"], bool)
    assert "gpu path" not in format_facts({**facts, "cuda_devices": []})
    gpu = {**facts, "cuda_devices": [{"index": 0, "name": "NVIDIA H200", "memory_gb": 139.8, "capability": "9.0"}],
           "torch_cuda": "13.0", "varlen_attention": True}
    lines = dict(line.split("  ", 1) for line in format_facts({**gpu, "triton_version": "3.6.0"}).splitlines())
    assert lines["cuda"].strip() == "0: NVIDIA H200 140 GiB (sm 9.0)"
    assert lines["gpu path"].strip() == ("torch CUDA 13.0; decode (by default) in CUDA graphs of Inductor-compiled "
                                         "layers (Triton 3.6.0); torch's varlen attention (packed update and prefill)")
    plain = format_facts({**gpu, "triton_version": None, "varlen_attention": False})
    assert "eager layers (Triton not installed: `pip install triton` compiles them)" in plain
    assert "padded prefill, per-row packed attention" in plain


def test_host_facts_without_measuring_has_the_same_keys(monkeypatch):
    monkeypatch.setenv("TILLER_EXPERTS_KERNEL", "0")
    monkeypatch.delenv("TILLER_DECODE_KERNEL", raising=False)
    facts = hostinfo.host_facts(measure=False)
    assert facts["speed_env"].get("TILLER_EXPERTS_KERNEL") == "0" and "TILLER_DECODE_KERNEL" not in facts["speed_env"]
    assert all(facts[k] is None for k in hostinfo.GEMM_KEYS)
    assert facts["bf16_decision"] == bf16_decision().use_bf16
    assert set(hostinfo.compact_host_facts(measure=False)) == set(hostinfo.COMPACT_KEYS)
