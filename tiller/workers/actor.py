"""ActorRolloutRefWorker: the policy (training), its rollout engine and the frozen reference policy.

verl's hybrid engine as a plain class: one worker holds the actor module, a rollout engine that
shares it (in-process engines read the actor's weights; `sync_rollout_weights` refreshes a bf16 copy)
and, when a KL term is used, the reference policy (a frozen copy, or the LoRA base with adapters off).
Every method takes and returns a `Batch` (or plain values), so `tiller.distributed` can run copies of
this class as Ray actors with the batch split across ranks (dispatch "dp"); global token and sequence
counts come from `all_reduce_sum`, so the loss normalisation is global.

Actor update (PPO, Schulman et al. 2017; verl's `dp_actor.update_policy`): for each of `ppo_epochs`
passes, split the batch into mini-batches of `ppo_mini_batch_size x n` samples (divided among ranks),
each into micro-batches of `ppo_micro_batch_size_per_gpu`; per micro-batch
    loss = agg(policy_loss) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(KL(pi || ref)),
aggregated with the mini-batch's global counts so the accumulated gradient is the mini-batch gradient;
then clip the global grad norm and take an AdamW step (skipped when the norm is not finite). The lr
schedule advances once per RL step.

Rollout correction: when the batch carries `rollout_is_weights[B, T]` (verl's TIS, computed by the
driver from old vs rollout logprobs) each token's policy loss is multiplied by its weight before
aggregation, as verl's losses do; rejected tokens arrive with response_mask 0.

Deviation from verl: when the update is exactly on-policy (one epoch, one mini-batch) the behaviour
logprobs are the detached current logprobs of the same forward, which saves a forward pass (verl does
the same with `use_rollout_log_probs` off and on-policy batches in recent versions). The rollout-vs-actor
mismatch metrics (`training/rollout_probs_diff_*`) are then computed here, from those logprobs and the
batch's `rollout_log_probs`, summed over micro-batches and ranks.

Letters: `B` samples, `P` prompt width, `T` response width.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import sys
import time
from dataclasses import fields as dataclass_fields, replace

import numpy as np
import torch

from tiller.algos.aggregate import aggregate_loss
from tiller.algos.distill import FULL_VOCAB_LOSS_MODES, distillation_loss, gjsd_loss
from tiller.algos.entropy import (entropy_from_logits, head_logprobs_and_entropy, logprobs_and_entropy,
                                  logprobs_from_logits, sum_pi_squared_from_logits)
from tiller.algos.token_masks import high_entropy_mask, off_policy_sequence_mask
from tiller.algos.kl import importance_weighted_kl, kl_penalty
from tiller.algos.policy_losses import (FORCED_LOSS_AGG_MODE, IS_WEIGHTS_INSIDE, bypass_loss_mask, get_policy_loss,
                                        rollout_is_weights_for)
from tiller.algos.rollout_correction import (
    MISMATCH_SUM_KEYS,
    merge_mismatch_sums,
    mismatch_metrics,
    mismatch_sums,
)
from tiller.algos.utils import masked_mean
from tiller.config.edge import given_under
from tiller.distributed import context as dist_ctx
from tiller.errors import ConfigError
from tiller.hostinfo import bf16_compute_allowed
from tiller.rollout.graphed_decode import capture_sizes, native_decode_options
from tiller.models import routing
from tiller.models.checkpoint import load_checkpoint, save_checkpoint
from tiller.models.compile import compile_layers
from tiller.models.chat_template import set_chat_template
from tiller.models.loading import load_causal_lm, load_tokenizer
from tiller.models.lora import attach_lora, lora_enabled, lora_template, merged_state_dict
from tiller.models.quant import bnb_config, dequantized_merge, is_quantized
from tiller.models.ref_sync import RefSync
from tiller.models.vision import is_vision_model, load_processor, vision_tower
from tiller.protocol import Batch, to_device
from tiller.rollout import build_rollout_engine, SamplingParams
from tiller.rollout.agent import tools_kwargs_of
from tiller.rollout.verl_agent_loop import build_rollout_loop
from tiller.rollout.agent_endpoint import AgentEndpoint, run_agent_episodes
from tiller.rollout.environments import load_environment, run_env_episodes
from tiller.rollout.episodes import load_agent_function, rows_from_episodes
from tiller.rollout.vllm_engine import VLM_REFUSED
from tiller.workers.common import (
    Float32Head,
    autocast,
    read_metrics,
    read_update_metrics,
    fp32_lm_head,
    epoch_passes,
    counted_rows,
    global_counts,
    build_optimizer,
    build_scheduler,
    forward_options,
    lane_plan,
    layer_hooks,
    pad_right,
    position_ids_from_mask,
    refuse_lanes_under_distributed,
    response_forward,
    run_in_lanes,
    prepare_process,
)
from tiller.workers.micro_batches import MicroBatches, lane_rows, split_micro_batches
from tiller.models.layer_masks import has_recurrent_layers, text_config
from tiller.workers.packed import (PackedRows, enable_checkpointing, fused_head, packed_response_forward, packs,
                                  scatter_rows)
from tiller.workers.ulysses import check_heads, seq_parallel_groups, ulysses_response_forward
from tiller.workers.prm import ImplicitPRM
from tiller.workers.router_aux import RouterAux, micro_batch_aux


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _routes_tensor(out, P: int, T: int) -> torch.Tensor:
    """The rollout's routing (`RolloutOutput.routed_experts`) laid out as input_ids [B, P + T, layers, top-k]: prompts
    left-padded, responses right-padded, -1 on padding (and on each row's last token, which no forward routed)."""
    first = out.routed_experts[0]
    table = torch.full((len(out), P + T, *first.shape[1:]), -1, dtype=first.dtype)
    for i, (p_ids, r_ids, routes) in enumerate(zip(out.prompt_ids, out.response_ids, out.routed_experts)):
        p, r = min(len(p_ids), P), min(len(r_ids), T)
        table[i, P - p:P] = routes[len(p_ids) - p:len(p_ids)]
        table[i, P:P + r] = routes[len(p_ids):len(p_ids) + r]
    return table


def _version_tensor(per_row: list[list[int]], T: int) -> torch.Tensor:
    """[B, T] policy versions of each row's response tokens (asynchronous RL), padded with the row's last (-1 for
    a row without any)."""
    versions = torch.zeros((len(per_row), T), dtype=torch.long)
    for i, vs in enumerate(per_row):
        vs = list(vs[:T]) or [-1]
        versions[i, :len(vs)] = torch.tensor(vs, dtype=torch.long)
        versions[i, len(vs):] = vs[-1]
    return versions


ROLES = ("actor_rollout_ref", "rollout")
"""ActorRolloutRefWorker roles: the hybrid worker (actor, rollout, reference), or a rollout pool's worker."""


class ActorRolloutRefWorker:
    """Actor + rollout + reference in one process (see module docstring).

    Args:
        config: the `RLConfig` (only `actor_rollout_ref`, `data` and `trainer` are read).
        total_training_steps: length of the lr schedule.
        need_ref: load a reference policy (KL loss or KL in reward).
        agent_app: for agent rollouts (`rollout.agent.path`), the OpenAI app factory the agent endpoint serves
            (`tiller.rollout.agent_endpoint.AppFactory`; the trainer hands it `tiller.serve.app.agent_app`).
        tool_loop: a multi-turn loop object in place of verl's `multi_turn` one (`.tools`, `.generate(engine,
            tokenizer, prompt_ids, sampling, ...)` -> `AgentRolloutOutput`; TRL's `tiller.trl.tool_loop`).
    """

    def __init__(self, config, total_training_steps: int, need_ref: bool = False, agent_app=None, tool_loop=None,
                 role: str = "actor_rollout_ref", lazy_rollout: bool = False):
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker role must be one of {ROLES}, got {role!r}")
        self.role = role
        self._rollout = None  # the engine (`rollout`); lazy_rollout: built on first use (a Ray rollout pool generates)
        self.agent_app = agent_app
        self._endpoints: dict[str, AgentEndpoint] = {}  # agent rollouts: the OpenAI endpoint of each engine
        self._mismatch_parts = None
        self.cfg = config
        arr = config.actor_rollout_ref
        self.actor_cfg, self.rollout_cfg = arr.actor, arr.rollout
        # verl's multi_turn.enable: each sample a multi-turn tool conversation (tiller.rollout.agent), as tiller eval
        # (or a front end's own loop, e.g. TRL's tools: `tool_loop`, in-process only)
        self.tool_loop = tool_loop if tool_loop is not None else \
            build_rollout_loop(arr.rollout, config.data.apply_chat_template_kwargs, config=config)
        prepare_process(config.trainer)
        # fresh heads / LoRA weights initialise the same in-process and in every Ray rank
        torch.manual_seed(config.trainer.seed)
        self.device = torch.device(config.trainer.device)
        if arr.model.external_lib:
            import importlib

            importlib.import_module(arr.model.external_lib)
        tok_path = arr.model.tokenizer_path or config.data.tokenizer or arr.model.path
        self.tokenizer = load_tokenizer(tok_path, padding_side="left", trust_remote_code=arr.model.trust_remote_code)
        # verl's model.custom_chat_template: the agent endpoint renders with it and the checkpoints save it
        set_chat_template(self.tokenizer, arr.model.custom_chat_template)
        compute = torch.bfloat16 if self.actor_cfg.dtype in ("bfloat16", "bf16") else torch.float32
        module = load_causal_lm(arr.model.path, dtype="float32", trust_remote_code=arr.model.trust_remote_code,
                                device=self.device, override_config=arr.model.override_config,
                                key="actor_rollout_ref.model.override_config",
                                quantization_config=bnb_config(arr.model, compute))  # QLoRA: load_in_4bit
        # LoRA: fresh adapters (model.lora_rank > 0) or a saved adapter to continue from (model.lora_adapter_path)
        self.lora = lora_enabled(arr.model)
        module = attach_lora(module, arr.model, "actor_rollout_ref.model")
        # weightless copy of the adapter-wrapped structure: peft merges the adapters into it at a vllm weight sync
        # (QLoRA: the 4-bit base is dequantized and the adapters merged at each sync instead, tiller.models.quant)
        self._lora_template = lora_template(module) if self.lora and arr.rollout.name == "vllm" and \
            not is_quantized(module) else None
        if arr.model.lm_head_fp32:  # before the reference copies the module: both heads in fp32
            fp32_lm_head(module, "actor_rollout_ref.model.lm_head_fp32")
        if role == "rollout":
            self._init_rollout_only(module)
            return
        self.ref_module = None
        if need_ref and not self.lora:
            self.ref_module = copy.deepcopy(module).requires_grad_(False).eval()
        ref_cfg = arr.ref
        self._ref_sync = None  # TR-DPO: the reference follows the policy every N optimizer steps
        if self.ref_module is not None and ref_cfg.ref_model_sync_steps:
            self._ref_sync = RefSync(ref_cfg.ref_model_sync_steps, ref_cfg.ref_model_mixup_alpha,
                                     "actor_rollout_ref.ref.ref_model_sync_steps")
        # on-policy distillation: frozen teachers, scored like the reference; several are routed per sample by the
        # batch's `teacher_index` (positions in sorted(algorithm.distill.teachers), the trainer's order)
        distill = config.algorithm.distill
        paths = ([distill.teacher_path] if distill.teacher_path
                 else [distill.teachers[k] for k in sorted(distill.teachers)])
        self.teachers = [self._load_teacher(path, arr.model.trust_remote_code) for path in paths]
        self.prm = None  # PRIME: the implicit PRM (trained) and its frozen reference
        if config.algorithm.adv_estimator == "prime":
            self.prm = ImplicitPRM(config, self.device)
        self.vision = is_vision_model(module)
        if self.actor_cfg.freeze_vision_tower:
            if not self.vision:
                raise ConfigError("actor_rollout_ref.actor.freeze_vision_tower=True but the model "
                                  f"({type(module).__name__}) has no vision tower")
            vision_tower(module).requires_grad_(False)
        if arr.model.enable_gradient_checkpointing:
            enable_checkpointing(module)  # its recompute keeps the packed forward's attention (use_remove_padding)
        module.train()
        self.module = module
        self._forward_opts = forward_options(module, self.actor_cfg.share_prompt_forward)
        # a mixture-of-experts policy's router load-balancing loss in the update (TRL's router_aux_loss_coef)
        self._router_aux = RouterAux(module, "actor_rollout_ref.actor.router_aux_loss_coef") \
            if self.actor_cfg.router_aux_loss_coef else None
        # MoE routing replay (verl's router_replay R2 / R3, tiller.models.routing): the routers hooked; what a forward
        # does with them is `_routing_mode` (None, "record" or "replay"), set by the pass that runs it
        self._replay, self._ref_replay = self.actor_cfg.router_replay.mode, ref_cfg.router_replay.mode
        self._routing_mode: str | None = None
        self._recorded: list[torch.Tensor] = []
        self._routing_stats: list[torch.Tensor] = []
        if self._replay != "disabled" or (self._ref_replay != "disabled" and self.ref_module is None):
            self._routes_shape = routing.install(module, "actor_rollout_ref.actor.router_replay.mode")
        if self._ref_replay != "disabled" and self.ref_module is not None:
            routing.install(self.ref_module, "actor_rollout_ref.ref.router_replay.mode")
        # verl's use_remove_padding: rows packed into one sequence per micro-batch (tiller.workers.packed)
        self._remove_padding = packs(module, "actor_rollout_ref.model.use_remove_padding",
                                     bool(arr.model.use_remove_padding) and self._forward_opts["logits_to_keep"])
        # Ulysses sequence parallelism: groups of ranks split each packed micro-batch (tiller.workers.ulysses)
        self._sp = self._seq_parallel(module) if dist_ctx.is_distributed() else None
        self.sp_size = self._sp.size if self._sp is not None else 1
        # verl's use_fused_kernels: the LM head run with the log-probs, chunk by chunk (`_fused_head`)
        self._fused_kernels = bool(arr.model.use_fused_kernels)
        self._fused_heads: dict[int, tuple | None] = {}
        if self._fused_kernels and not (self._remove_padding and self._sp is None):
            print("actor_rollout_ref.model.use_fused_kernels=True: the LM head runs fused with the log-probs in the "
                  "packed forward without sequence parallelism (model.use_remove_padding=True, "
                  "ulysses_sequence_parallel_size=1); this run's forwards compute the logits whole", file=sys.stderr)
        self._thread_poll, self._poll_hooks = None, []  # async RL: set_thread_poll
        self._lent_lanes, self._lane_threads, self._in_lanes = 0, None, False  # set_lent_lanes
        refuse_lanes_under_distributed("actor_rollout_ref.actor.update_lanes", self.actor_cfg.update_lanes)
        strategy = self.actor_cfg.strategy.replace("fsdp2", "fsdp")
        # FSDP2 shards in place and every forward all-gathers (a collective): ranks sampling different
        # lengths would deadlock, so the rollout runs on an unsharded copy refreshed at weight sync.
        # LoRA: the engine runs the adapter-injected base model (the PeftModel wrapper hides `.model.layers`)
        self.rollout_module = module.get_base_model() if self.lora else module
        # (vllm keeps its own weights, but the copy is still the unsharded module a checkpoint saves)
        self._rollout_is_copy = strategy == "fsdp" and dist_ctx.is_distributed()
        if self._rollout_is_copy:
            self.rollout_module = copy.deepcopy(module).requires_grad_(False)
        # bf16: FSDP2 all-gathers bf16 parameters (MixedPrecisionPolicy; fp32 shards, fp32 grad reduction)
        bf16 = self.actor_cfg.dtype in ("bfloat16", "bf16") and bf16_compute_allowed(self.device.type,
                                                                                    "actor_rollout_ref.actor.dtype")
        param_dtype = torch.bfloat16 if bf16 else None
        # use_torch_compile: each decoder layer compiled (tiller.models.compile), before FSDP2 shards them (torchtitan's
        # order); the reference's key follows the actor's by default
        compile_ref = self.ref_module is not None and (self.actor_cfg.use_torch_compile if arr.ref.use_torch_compile
                                                       is None else arr.ref.use_torch_compile)
        self.compiled = compile_layers(module, "actor_rollout_ref.actor.use_torch_compile") \
            if self.actor_cfg.use_torch_compile else None
        if compile_ref:
            compile_layers(self.ref_module, "actor_rollout_ref.ref.use_torch_compile")
        self.model = dist_ctx.wrap_model(module, strategy=strategy, param_dtype=param_dtype)
        self.optimizer = build_optimizer(self.model, self.actor_cfg.optim, "actor_rollout_ref.actor.optim")
        self.scheduler = build_scheduler(self.optimizer, self.actor_cfg.optim, total_training_steps)
        if not lazy_rollout:
            self._rollout = self._checked_rollout()

    def _init_rollout_only(self, module) -> None:
        """role="rollout": a worker of asynchronous RL's rollout pool (verl's standalone rollout): the model, its
        engine, no optimizer, reference or teacher; its weights come from the trainer (`load_rollout_weights`)."""
        self.ref_module, self._ref_sync, self.teachers, self.prm = None, None, [], None
        self.vision = is_vision_model(module)
        self.module = module.requires_grad_(False).eval()
        self.model = module
        self.rollout_module = module.get_base_model() if self.lora else module
        self._rollout_is_copy = False
        self._pool_version = -1  # the policy version this worker's engine holds (`load_rollout_weights`)
        self._remove_padding, self._sp, self.sp_size = False, None, 1
        self._thread_poll, self._poll_hooks = None, []
        self._lent_lanes, self._lane_threads, self._in_lanes = 0, None, False
        self._rollout = self._checked_rollout()

    def _checked_rollout(self):
        engine = self._build_rollout()
        if self.vision and "multi_modal" not in inspect.signature(engine.generate).parameters:
            raise ConfigError(f"actor_rollout_ref.rollout.name={self.rollout_cfg.name}: this engine takes text prompts "
                              "only, and a vision-language model's prompts carry images; use rollout.name=native or hf")
        return engine

    @property
    def rollout(self):
        """The rollout engine; with lazy_rollout (asynchronous RL on Ray: the trainer's workers, whose samples come
        from the rollout pool) it starts at its first use (validation), vLLM then given the actor's weights (every
        rank generates then: the gather under FSDP2 is a collective they all join)."""
        if self._rollout is None:
            self._rollout = self._checked_rollout()
            if self.rollout_cfg.name == "vllm":  # (vLLM loaded model.path)
                self.sync_rollout_weights()
        return self._rollout

    @rollout.setter
    def rollout(self, engine) -> None:  # (tests put scripted engines in its place)
        self._rollout = engine

    def parallel_layout(self) -> dict[str, int]:
        """This rank's place: `rank`, `world`, `sp` (sequence-parallel group size), `sp_rank` (place in it)."""
        return {"rank": dist_ctx.rank(), "world": dist_ctx.world_size(), "sp": self.sp_size,
                "sp_rank": self._sp.rank if self._sp is not None else 0}

    def _seq_parallel(self, module):
        """The sequence-parallel group of actor.ulysses_sequence_parallel_size (> 1), its requirements checked."""
        size = int(self.actor_cfg.ulysses_sequence_parallel_size or 1)
        if size <= 1:
            return None
        key = f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size}"
        if has_recurrent_layers(module):
            raise ConfigError(f"{key}: {text_config(module.config).model_type}'s recurrent layers carry a state along "
                              "the sequence, which is not split over ranks; set it to 1")
        if not self._remove_padding:
            raise ConfigError(f"{key} splits the packed sequence: set actor_rollout_ref.model.use_remove_padding=True "
                              "(verl requires it too)")
        if self.vision:
            raise ConfigError(f"{key}: a vision-language model's image rows keep the padded forward, which is not "
                              "split over ranks; set it to 1")
        if self.prm is not None:
            raise ConfigError(f"{key}: PRIME's implicit PRM is not split over ranks; set it to 1")
        check_heads(module.config, size)
        return seq_parallel_groups(size)

    def _load_teacher(self, path: str, trust_remote_code: bool):
        """The distillation teacher, frozen; its tokenizer must map text to the same ids as the student's."""
        teacher_tok = load_tokenizer(path, padding_side="left", trust_remote_code=trust_remote_code)
        if teacher_tok.get_vocab() != self.tokenizer.get_vocab():
            raise ConfigError(f"algorithm.distill.teacher_path={path}: the teacher's tokenizer differs from the "
                              "student's (on-policy distillation scores the student's token ids with the teacher, so "
                              "both need the same vocabulary)")
        teacher = load_causal_lm(path, dtype="float32", trust_remote_code=trust_remote_code, device=self.device)
        return teacher.requires_grad_(False).eval()

    # ------------------------------------------------------------------------------------- rollout
    def _build_rollout(self, module=None):
        """The configured engine around `module` (default: the rollout module shared with the actor)."""
        name, r = self.rollout_cfg.name, self.rollout_cfg
        if name == "vllm":  # vLLM loads the actor's model dir; its weights follow via sync_rollout_weights
            if self.vision:
                raise ConfigError(f"actor_rollout_ref.rollout.name=vllm: {VLM_REFUSED}; set "
                                  "actor_rollout_ref.rollout.name=native (the default) or hf")
            m = self.cfg.actor_rollout_ref.model
            extra = dict(trust_remote_code=m.trust_remote_code, enable_chunked_prefill=r.enable_chunked_prefill)
            # verl's vLLM knobs the user set (else vLLM's own defaults, which depend on the device and model: e.g.
            # 1024 sequences on an H100, prefix caching off for models that cannot cache)
            knobs = dict(max_num_seqs=r.max_num_seqs, enable_prefix_caching=r.enable_prefix_caching,
                         scheduling_policy=r.scheduling_policy, disable_log_stats=r.disable_log_stats)
            extra.update({key: value for key, value in knobs.items()
                          if given_under(self.cfg, f"actor_rollout_ref.rollout.{key}")})
            # the same config changes the actor got (vLLM's own copy of the HF config); vLLM picks its own
            # attention backend, so the HF attention implementation stays with the actor
            overrides = {k: v for k, v in m.override_config.items() if k != "attn_implementation"}
            if overrides:
                extra["hf_overrides"] = overrides
            if m.tokenizer_path or self.cfg.data.tokenizer:  # vLLM decodes for stop strings with it
                extra["tokenizer"] = m.tokenizer_path or self.cfg.data.tokenizer
            kwargs = {**extra, **r.engine_kwargs}
            if r.cudagraph_capture_sizes:  # verl's way: into vLLM's compilation_config (engine_kwargs' merged)
                compilation = kwargs.get("compilation_config") or {}
                if isinstance(compilation, str):
                    compilation = json.loads(compilation)
                kwargs["compilation_config"] = {
                    **compilation, "cudagraph_capture_sizes": capture_sizes(r.max_num_seqs, r.cudagraph_capture_sizes)}
            engine = build_rollout_engine(
                "vllm", m.path, self.tokenizer, dtype=r.dtype,
                seed=self.cfg.trainer.seed, gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tensor_model_parallel_size, enforce_eager=r.enforce_eager is not False,
                enable_sleep_mode=bool(r.free_cache_engine) and self.device.type == "cuda",
                max_num_batched_tokens=r.max_num_batched_tokens, engine_kwargs=kwargs)
            engine.check_weight_sync()  # RL syncs weights every step: a sync vLLM gets wrong stops the run now
            return engine
        opts = dict(dtype=r.dtype, seed=self.cfg.trainer.seed, **r.engine_kwargs)
        if r.enable_rollout_routing_replay:  # the engine records each token's experts (R3, MoE load metrics; native)
            opts["record_routing"] = True
        if name == "native":  # CUDA graphs on a GPU, the compiled step on a CPU (tiller.rollout.graphed_decode)
            opts.setdefault("max_num_seqs", r.max_num_seqs)  # rows decoded together (vLLM's meaning)
            for key, value in native_decode_options(r.enforce_eager, self.device.type,
                                                    r.cudagraph_capture_sizes).items():
                opts.setdefault(key, value)
        try:
            return build_rollout_engine(name, module or self.rollout_module, self.tokenizer, **opts)
        except ModuleNotFoundError:
            if name != "native":
                raise
            for key in ("compile_decode", "static_decode", "capture_sizes", "cuda_graphs", "static_attention",
                        "max_num_seqs", "packed_prefill"):
                opts.pop(key, None)
            return build_rollout_engine("hf", module or self.rollout_module, self.tokenizer, **opts)

    # ------------------------------------------------------------- asynchronous RL: the producer's engine
    def set_lent_lanes(self, lanes: int = 0, threads: int = 1) -> None:
        """Asynchronous RL in one process: the update runs `lanes` more micro-batch lanes (the producer's threads),
        every lane on `threads` torch threads; 0 returns to actor.update_lanes."""
        self._lent_lanes, self._lane_threads = max(0, lanes), max(1, threads)

    def _poll(self, *_args) -> None:
        if self._thread_poll is not None and not self._in_lanes:
            self._thread_poll()

    def set_thread_poll(self, poll=None) -> None:
        """Asynchronous RL in one process: call `poll()` (`tiller.trainer.async_rollout.ThreadSharing`, which
        sets the calling thread's torch thread count) at every decoder layer of the actor's forward and
        backward and before each micro-batch; None removes the hooks."""
        for handle in self._poll_hooks:
            handle.remove()
        self._poll_hooks = layer_hooks(self.model, self._poll) if poll is not None else []
        self._thread_poll = poll

    def start_producer_engine(self) -> None:
        """A second engine on a frozen copy of the rollout module, for the rollout producer thread
        (`tiller.trainer.async_rollout`): the actor trains while the copy samples; its weights change only
        through `load_producer_weights`, called in the producer's thread."""
        module = copy.deepcopy(self.rollout_module)
        for p in module.parameters():
            p.grad = None
        self._producer_engine = self._build_rollout(module.requires_grad_(False).eval())

    def producer_weights(self) -> dict[str, torch.Tensor]:
        """A snapshot of the actor's current weights for the producer (cloned: the actor keeps training)."""
        with torch.no_grad():
            return {k: v.detach().clone() for k, v in self.rollout_module.state_dict().items()}

    def load_producer_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Install a snapshot from `producer_weights` in the producer's engine (its own copy)."""
        self._producer_engine.update_weights(state)

    # ------------------------------------------------------------- asynchronous RL on Ray: the rollout pool
    def publish_rollout_weights(self) -> dict[str, torch.Tensor] | None:
        """The actor's full weights for a rollout pool (`load_rollout_weights`), keys as the unwrapped module's,
        on rank 0 (None on the others). Every rank calls it: under FSDP2 it gathers (unless the rollout copy,
        gathered by `sync_rollout_weights` just before, already holds them)."""
        if self._rollout_is_copy and self.rollout_cfg.name != "vllm":  # (vllm's sync leaves the copy as it was)
            state = self.rollout_module.state_dict()
        else:
            state = dist_ctx.full_state_dict(self.model)
        return {k: v.detach().cpu() for k, v in state.items()} if dist_ctx.rank() == 0 else None

    def load_rollout_weights(self, state: dict[str, torch.Tensor], version: int = -1) -> None:
        """role="rollout": install weights the trainer published (`publish_rollout_weights`), of policy `version`,
        in this engine."""
        self.module.load_state_dict(state)
        self.sync_rollout_weights()
        self._pool_version = version

    def _board_hook(self, prompts: Batch):
        """A rollout pool's partial rollouts (meta `weights_board`, a `tiller.distributed.ray_group.WeightBoard`):
        the native engine's weights hook, called between decode steps. It asks the board for the newest published
        weights (at most every `board.poll_s` s), loads a newer version (the KV cache is kept, as in one process),
        returns the version in use, and raises once the trainer has stopped (the generation is abandoned)."""
        board, step = prompts.meta["weights_board"], prompts.meta.get("global_step")
        self._pool_version = int(prompts.meta["policy_version"])
        asked = [float("-inf")]

        def hook() -> int:
            now = time.monotonic()
            if now - asked[0] >= board.poll_s:
                asked[0] = now
                version, ref, stopped = board.latest(step)
                if stopped:
                    raise RuntimeError("the trainer stopped: this rollout worker abandons its generation")
                if version > self._pool_version and ref is not None:
                    self.load_rollout_weights(board.fetch(ref), version)
            return self._pool_version

        return hook

    def generate_sequences(self, prompts: Batch) -> Batch:
        """Sample `n` responses per prompt.

        prompts: fields `prompt_ids` (list[int] per prompt) plus any per-prompt fields (copied to each
            sample); meta `sampling` (kwargs of `SamplingParams`), `prompt_width` P, `response_width` T.
        Returns B = len(prompts) x n rows (the n samples of a prompt adjacent) with tensors
            prompts[B, P] (left-padded), responses[B, T], input_ids / attention_mask / position_ids[B, P+T],
            response_mask[B, T], rollout_log_probs[B, T] and field `finish_reason`.
        """
        sampling = SamplingParams(**prompts.meta["sampling"])
        if self.rollout_cfg.agent.path or self.rollout_cfg.agent.env_path:
            return self._generate_episodes(prompts, sampling)
        P, T = int(prompts.meta["prompt_width"]), int(prompts.meta["response_width"])
        free_cache = self.rollout_cfg.name == "vllm" and self.rollout_cfg.free_cache_engine
        if free_cache:  # verl's hybrid engine: KV cache and weights on the GPU only while generating
            self.rollout.wake()
        try:
            out = self._generate_seeded(prompts, sampling)
        finally:
            if free_cache:
                self.rollout.sleep()
        pad = self.tokenizer.pad_token_id
        B = len(out)
        prompt_t = torch.full((B, P), pad, dtype=torch.long)
        resp_t = torch.full((B, T), pad, dtype=torch.long)
        pmask = torch.zeros((B, P), dtype=torch.long)
        rmask = torch.zeros((B, T), dtype=torch.long)
        rlogp = torch.zeros((B, T), dtype=torch.float32)
        for i, (p_ids, r_ids, lps) in enumerate(zip(out.prompt_ids, out.response_ids, out.logprobs)):
            p_ids, r_ids, lps = p_ids[-P:], r_ids[:T], lps[:T]
            prompt_t[i, P - len(p_ids):] = torch.tensor(p_ids, dtype=torch.long)
            pmask[i, P - len(p_ids):] = 1
            if r_ids:
                resp_t[i, :len(r_ids)] = torch.tensor(r_ids, dtype=torch.long)
                rmask[i, :len(r_ids)] = 1
                rlogp[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
        attention_mask = torch.cat([pmask, rmask], dim=1)
        if self.tool_loop is not None:  # tool-response / template tokens: context, out of the loss (verl's mask)
            for i, mask in enumerate(out.response_mask):
                rmask[i, :len(mask[:T])] = torch.tensor(mask[:T], dtype=torch.long)
        batch = prompts.select([k for k in prompts.fields if k != "prompt_ids"]).repeat(sampling.n)
        batch.meta = dict(prompts.meta)
        batch["prompts"], batch["responses"] = prompt_t, resp_t
        batch["input_ids"] = torch.cat([prompt_t, resp_t], dim=1)
        batch["attention_mask"] = attention_mask
        batch["position_ids"] = position_ids_from_mask(attention_mask)
        batch["response_mask"] = rmask
        batch["rollout_log_probs"] = rlogp
        batch["finish_reason"] = list(out.finish_reason)
        if self.tool_loop is not None:  # per sample: its tool calls' rewards (the scorer's extra_info) and counts
            for name in ("tool_rewards", "num_turns", "num_tool_calls", "tool_errors"):
                batch[name] = list(getattr(out, name))
            if out.messages:  # (TRL's loop: each completion's messages, for its reward functions)
                batch["completion_messages"] = list(out.messages)
            if out.states:  # (TRL's episodes, verl agent loops' reward_score: for the reward side)
                batch["agent_state"] = list(out.states)
        if out.token_versions:  # asynchronous RL: the version that sampled each token
            batch["rollout_token_version"] = _version_tensor(out.token_versions, T)
        if out.routed_experts:  # R3: the experts the rollout routed each token to
            batch["routed_experts"] = _routes_tensor(out, P, T)
        return batch

    # ------------------------------------------------------------------------------- agent rollouts
    def _agent_endpoint(self, engine, key: str, max_model_len: int, max_tokens: int):
        """tiller's OpenAI endpoint on loopback in front of `engine` (started once per engine, kept: `key` is
        "rollout", or "producer" for the asynchronous producer's engine)."""
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            if self.agent_app is None:
                raise ConfigError("actor_rollout_ref.rollout.agent.path: this worker was built without an agent "
                                  "app (ActorRolloutRefWorker(agent_app=tiller.serve.app.agent_app))")
            endpoint = AgentEndpoint(engine, self.tokenizer, app=self.agent_app, max_model_len=max_model_len,
                                     max_tokens_default=max_tokens)
            # the agent's chats render as the prompt set does (verl's agent loop reads the same key)
            endpoint.served.chat_template_kwargs = dict(self.cfg.data.apply_chat_template_kwargs)
            # the format the model writes tool calls in (gpt-oss, not served, is refused with agent.path)
            endpoint.served.tool_call_parser = self.rollout_cfg.multi_turn.format
            self._endpoints[key] = endpoint
        return endpoint

    def _episode_engine(self, prompts: Batch) -> tuple[object, str, int, object]:
        """(engine, its name, policy version, weights hook) of an agent step: the rollout engine at the step
        number, or, for the asynchronous producer (meta engine=producer), its own engine at the version its
        weights_hook reports (the weights it loaded; raises when the trainer asked the producer to stop), the
        hook going on to the native engine's continuous batcher (new weights between decode steps with
        async_training.partial_rollout, each token's version recorded)."""
        if prompts.meta.get("engine") == "producer":
            engine, hook = self._producer_engine, prompts.meta["weights_hook"]
            if getattr(engine, "num_threads", 0) is None:  # native: its batcher threads take the producer's count
                engine.num_threads = torch.get_num_threads()
            return engine, "producer", int(hook()), hook if self.rollout_cfg.name == "native" else None
        if "policy_version" in prompts.meta:  # a rollout pool's worker (asynchronous RL on Ray): the version it holds
            hook = self._board_hook(prompts) if prompts.meta.get("weights_board") is not None else None
            return self.rollout, "producer", int(prompts.meta["policy_version"]), hook
        return self.rollout, "rollout", int(prompts.meta.get("global_step", 0)), None

    def _run_episodes(self, prompts: Batch, samples: list[dict], sampling, P: int, T: int) -> tuple[list, str]:
        """One episode per sample: the agent function through the endpoint of the step's engine, or the
        environment loop on that engine (`_episode_engine`); returns (episodes, the engine's name)."""
        a = self.rollout_cfg.agent
        engine, engine_name, version, hook = self._episode_engine(prompts)
        if not a.path:
            return run_env_episodes(engine, self.tokenizer, load_environment(a.env_path, a.env_name), samples,
                                    sampling, max_turns=a.max_turns, max_response_length=T, policy_version=version,
                                    max_concurrency=a.max_concurrency, max_context=a.max_context,
                                    weights_hook=hook), engine_name
        max_len = int(getattr(self.module.config, "max_position_embeddings", 0) or (P + T) * 8)
        endpoint = self._agent_endpoint(engine, engine_name, max_len, T)
        endpoint.served.policy_version = version
        # the distribution the trainer assumes: requests may not change it (logit_bias None = none allowed)
        endpoint.served.fixed_sampling = {"temperature": sampling.temperature if sampling.do_sample else 0.0,
                                          "top_p": sampling.top_p, "top_k": sampling.top_k,
                                          "min_p": sampling.min_p, "logit_bias": None,
                                          "repetition_penalty": sampling.repetition_penalty,
                                          "presence_penalty": sampling.presence_penalty,
                                          "frequency_penalty": sampling.frequency_penalty}
        if sampling.regex is not None:  # the rollout's regex constrains every request (the serve app's field)
            endpoint.served.fixed_sampling["guided_regex"] = sampling.regex
        agent = load_agent_function(a.path, a.name)
        if hook is not None:  # (the producer's endpoint: a native engine's continuous batcher)
            endpoint.served.batcher.weights_hook = hook
        try:
            return run_agent_episodes(endpoint, agent, samples, max_concurrency=a.max_concurrency,
                                      client=a.client), engine_name
        finally:
            if hook is not None:
                endpoint.served.batcher.weights_hook = None

    def _generate_episodes(self, prompts: Batch, sampling) -> Batch:
        """Agent / environment rollouts: `n` episodes per prompt, one row per recorded segment.

        Rows carry fields `episode` (index within this batch), `segment`, `policy_version`, `agent_reward`
        (asynchronous RL: also `rollout_token_version[B, T]`, each segment's version on its tokens, as plain
        rows record theirs); widths grow to the longest context / segment of the step (contexts are never
        truncated: the trained logprobs must be of the context that was sampled from)."""
        P, T = int(prompts.meta["prompt_width"]), int(prompts.meta["response_width"])
        fields = {k: list(prompts[k]) for k in prompts.fields}
        # several ranks (dispatch dp_parts: equal chunks, rank r's from prompt r x chunk): each sample keeps its
        # index in the step, and an environment episode its seed, as in one process (a step's episodes do not
        # depend on the world size; `tiller.trainer.episode_merge` offsets the episode ids alike)
        first = dist_ctx.group_rank() * len(prompts)
        if first and sampling.seed is not None:
            sampling = replace(sampling, seed=int(sampling.seed) + 7919 * first * sampling.n)
        samples = []
        for i in range(len(prompts)):
            raw = fields.get("raw_prompt", [None] * len(prompts))[i]
            for j in range(sampling.n):
                samples.append({"prompt": raw if raw is not None else fields["prompt_text"][i],
                                "prompt_text": fields["prompt_text"][i], "data_source": fields["data_source"][i],
                                "ground_truth": fields["ground_truth"][i],
                                "extra_info": dict(fields["extra_info"][i] or {}), "index": first + i,
                                "sample": j,
                                "prompt_ids": list(fields["prompt_ids"][i])})
        episodes, engine_name = self._run_episodes(prompts, samples, sampling, P, T)
        firsts = [list(fields["prompt_ids"][k // sampling.n]) for k in range(len(samples))]
        rows = rows_from_episodes(episodes, firsts)
        P = max([P] + [len(r["prompt_ids"]) for r in rows])
        T = max([T] + [len(r["response_ids"]) for r in rows])
        pad = self.tokenizer.pad_token_id
        B = len(rows)
        prompt_t = torch.full((B, P), pad, dtype=torch.long)
        resp_t = torch.full((B, T), pad, dtype=torch.long)
        pmask = torch.zeros((B, P), dtype=torch.long)
        rmask = torch.zeros((B, T), dtype=torch.long)
        rlogp = torch.zeros((B, T), dtype=torch.float32)
        for i, row in enumerate(rows):
            p_ids, r_ids = row["prompt_ids"], row["response_ids"]
            prompt_t[i, P - len(p_ids):] = torch.tensor(p_ids, dtype=torch.long)
            pmask[i, P - len(p_ids):] = 1
            if r_ids:
                resp_t[i, :len(r_ids)] = torch.tensor(r_ids, dtype=torch.long)
                rmask[i, :len(r_ids)] = 1
                rlogp[i, :len(r_ids)] = torch.tensor(row["logprobs"], dtype=torch.float32)
        per_prompt = [r["episode"] // sampling.n for r in rows]
        batch = prompts.select([k for k in prompts.fields if k not in ("prompt_ids", "raw_prompt")]).index(per_prompt)
        batch.meta = {**prompts.meta, "prompt_width": P, "response_width": T}
        attention_mask = torch.cat([pmask, rmask], dim=1)
        batch["prompts"], batch["responses"] = prompt_t, resp_t
        batch["input_ids"] = torch.cat([prompt_t, resp_t], dim=1)
        batch["attention_mask"] = attention_mask
        batch["position_ids"] = position_ids_from_mask(attention_mask)
        batch["response_mask"] = rmask
        batch["rollout_log_probs"] = rlogp
        batch["finish_reason"] = [r["finish_reason"] for r in rows]
        batch["episode"] = torch.tensor([r["episode"] for r in rows], dtype=torch.long)
        batch["segment"] = torch.tensor([r["segment"] for r in rows], dtype=torch.long)
        batch["policy_version"] = torch.tensor([r["policy_version"] for r in rows], dtype=torch.long)
        if engine_name == "producer":  # the staleness filter reads the tokens' versions (an empty row: none)
            batch["rollout_token_version"] = _version_tensor(
                [r["token_versions"] or [r["policy_version"]] for r in rows], T)
        batch["agent_reward"] = torch.tensor([episodes[r["episode"]].reward for r in rows], dtype=torch.float32)
        if any("scores" in ep.info for ep in episodes):  # OpenRLHF's scores: its dynamic-filtering signal (acc)
            acc = [float(ep.info.get("scores", ep.reward)) for ep in episodes]
            batch["agent_acc"] = torch.tensor([acc[r["episode"]] for r in rows], dtype=torch.float32)
        return batch

    def shutdown_endpoint(self) -> None:
        """Stop the agent endpoints (the rollout engine's, the producer's), if any were started."""
        endpoints, self._endpoints = self._endpoints, {}
        for endpoint in endpoints.values():
            endpoint.close()

    def _generate_seeded(self, prompts: Batch, sampling):
        """Generate in `meta["seed_chunks"]` equal prompt chunks over the group (default: one per rank),
        chunk c seeded `seed + 7919 c`: the samples then do not depend on how chunks map to ranks, so a
        run on N ranks can be reproduced in one process with seed_chunks=N."""
        ids = [list(p) for p in prompts["prompt_ids"]]
        rank, size = dist_ctx.group_rank(), dist_ctx.group_size()  # (a Ray rollout pool: no process group)
        chunks = int(prompts.meta.get("seed_chunks") or size)
        per_rank, rest = divmod(chunks, size)
        engine, hook = self.rollout, {}
        if prompts.meta.get("engine") == "producer":  # asynchronous RL: the producer's own copy
            engine = self._producer_engine
            if prompts.meta.get("weights_hook") is not None and self.rollout_cfg.name == "native":
                hook = {"weights_hook": prompts.meta["weights_hook"]}
        elif prompts.meta.get("weights_board") is not None:  # a rollout pool's partial rollouts (native: validated)
            hook = {"weights_hook": self._board_hook(prompts)}
        prompt_options = {}  # per-prompt options, cut with the chunks
        if self.tool_loop is not None:  # multi-turn tool conversations, seeded and chunked as plain samples
            engine = _ToolLoopEngine(self.tool_loop, engine, self.tokenizer)
            if "extra_info" in prompts:  # (verl BaseTool classes' create_kwargs)
                prompt_options["tools_kwargs"] = [tools_kwargs_of(e) for e in prompts["extra_info"]]
            if "agent_name" in prompts:  # verl's single_turn_agent rows: one turn, no tools
                prompt_options["single_turn"] = [name == "single_turn_agent" for name in prompts["agent_name"]]
            if getattr(self.tool_loop, "wants_rows", False):  # (verl's agent loops, TRL's loop: each row's fields)
                names = [k for k in prompts.fields if k not in ("prompt_ids", "multi_modal_inputs", "images")]
                prompt_options["rows"] = [{k: prompts[k][i] for k in names} for i in range(len(prompts))]
        if "multi_modal_inputs" in prompts:  # image prompts: their pixels go with them
            hook = {**hook, "multi_modal": list(prompts["multi_modal_inputs"])}
            if per_rank > 1:
                raise ConfigError("image prompts are generated in one seed chunk per rank in this version "
                                  "(meta seed_chunks > world size is for text prompts)")
        if sampling.seed is None or per_rank <= 1 or rest or len(ids) % per_rank:
            if sampling.seed is not None:
                sampling.seed = int(sampling.seed) + 7919 * rank * max(per_rank, 1)
            return engine.generate(ids, sampling, **hook, **prompt_options)
        size, out = len(ids) // per_rank, None
        for j in range(per_rank):
            seed = int(sampling.seed) + 7919 * (rank * per_rank + j)
            part = engine.generate(ids[j * size:(j + 1) * size], replace(sampling, seed=seed), **hook,
                                   **{k: v[j * size:(j + 1) * size] for k, v in prompt_options.items()})
            out = out if out is not None else type(part)()  # (tool conversations: AgentRolloutOutput, all fields)
            for f in dataclass_fields(part):
                getattr(out, f.name).extend(getattr(part, f.name))
        return out

    def sync_rollout_weights(self) -> None:
        """Push the actor's current weights to the rollout engine (a no-op for a shared fp32 module;
        under FSDP2 the gathered full weights go into the rollout's unsharded copy, on every rank; vllm
        gets the full state dict, LoRA adapters merged, through `load_weights`, woken first if asleep). An engine
        not started yet (lazy_rollout) takes them when it starts; the unsharded copy is refreshed all the same."""
        if self._rollout is None:
            if self._rollout_is_copy and self.rollout_cfg.name != "vllm":
                self.rollout_module.load_state_dict(dist_ctx.full_state_dict(self.model))
            return
        if self.rollout_cfg.name == "vllm":
            if is_quantized(self.module):  # QLoRA (one process): the dequantized base with the adapters merged
                state = dequantized_merge(self.module).state_dict()
            else:
                state = dist_ctx.full_state_dict(self.module)  # collective under FSDP2
            if self.lora and self._lora_template is not None:
                state = merged_state_dict(self._lora_template, state)
            self.rollout.wake()  # a sleeping vLLM holds no weights to load into; the next generate sleeps it
            self.rollout.update_weights(state)
        elif self._rollout_is_copy:
            self.rollout.update_weights(dist_ctx.full_state_dict(self.model))
        else:
            self.rollout.update_weights()

    def close_rollout(self) -> None:
        """Stop the rollout engine's own processes (vLLM's EngineCore) and the agent endpoint, if any."""
        self.shutdown_endpoint()
        close = getattr(self._rollout, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------------------- log-probs
    @contextlib.contextmanager
    def _routing_phase(self, mode: str | None):
        """Inside: the policy's (and reference's) forwards record their routing ("record"), replay the batch's
        `routed_experts` ("replay") or route themselves (None)."""
        self._routing_mode, self._recorded, self._routing_stats = mode, [], []
        try:
            yield
        finally:
            self._routing_mode = None

    @contextlib.contextmanager
    def _routing_session(self, mb: Batch):
        """Around one micro-batch's forward: the routing session of `_routing_mode` over its [b, P + T] tokens."""
        mode = self._routing_mode
        if mode is None:
            yield
            return
        b, width = mb["input_ids"].shape
        if mode == "record":
            table = routing.empty_table(b * width, *self._routes_shape, self.device)
        elif "routed_experts" not in mb:
            raise RuntimeError("routing replay: the batch has no routed_experts (R3: the rollout engine records them "
                               "with rollout.enable_rollout_routing_replay; R2: the old-logprob pass does)")
        else:
            table = mb["routed_experts"].to(self.device).reshape(b * width, *mb["routed_experts"].shape[2:])
        with routing.session(table, mode, torch.arange(b * width, device=self.device).view(b, width)) as s:
            yield
        if mode == "record":
            self._recorded.append(table.view(b, width, *table.shape[1:]).cpu())
        else:
            self._routing_stats.append(torch.stack([s.routed, s.agreed]))  # (on the device: read once per pass)

    def _response_logits(self, model, mb: Batch, temperature: float) -> tuple[torch.Tensor, int]:
        """Float logits / temperature at the first t response positions [b, t, V] of `model` on `mb`, and t."""
        with self._routing_session(mb):
            return self._forward_logits(model, mb, temperature)

    def _forward_logits(self, model, mb: Batch, temperature: float) -> tuple[torch.Tensor, int]:
        if self._sp is not None:
            local, layout = self._sp_forward(model, mb)
            return layout.gather(local.float() / temperature), layout.t_used
        logits, rows, t_used = self._model_logits(model, mb)
        if rows is not None:
            return scatter_rows(logits, rows).float() / temperature, t_used
        return logits.view(mb["responses"].shape[0], t_used, logits.shape[-1]).float() / temperature, t_used

    def _fused_head(self, model) -> tuple | None:
        """(decoder, LM head) of `model` where model.use_fused_kernels runs its head with the log-probs
        (`tiller.workers.packed.fused_head`, in the packed forward), else None (a model it does not fit: said once)."""
        if not (self._fused_kernels and self._remove_padding and self._sp is None):
            return None
        if id(model) not in self._fused_heads:
            parts = fused_head(model)
            if isinstance(parts, str):
                print(f"actor_rollout_ref.model.use_fused_kernels=True: {parts}; its forwards compute the logits "
                      "whole", file=sys.stderr)
                parts = None
            self._fused_heads[id(model)] = parts
        return self._fused_heads[id(model)]

    def _model_logits(self, model, mb: Batch) -> tuple[torch.Tensor, PackedRows | None, int]:
        """The model's response logits as it computes them (its dtype, no temperature): packed (use_remove_padding):
        ([K, V] of the K response tokens, the `PackedRows` saying where they go, t_used; packed where the batch is, the
        host); padded: ([B * t_used, V], None, t_used)."""
        P = mb["prompts"].shape[1]
        if self._remove_padding and "multi_modal_inputs" not in mb:
            logits, rows = packed_response_forward(model, mb["input_ids"], mb["attention_mask"], P, mb["response_mask"],
                                                   packed=True, device=self.device)
            return logits, rows, rows.t_used
        opts = self._forward_opts
        if opts["share_prompts"] and (RouterAux.collecting() or routing.active()):  # router loss or routing
            opts = {**opts, "share_prompts": False}
        mm = list(mb["multi_modal_inputs"]) if "multi_modal_inputs" in mb else None
        logits, t_used = response_forward(model, mb["input_ids"], mb["attention_mask"], P, mb["response_mask"],
                                          multi_modal=mm, device=self.device, **opts)  # trimmed on the host
        return logits.reshape(-1, logits.shape[-1]), None, t_used

    def _logp_entropy(self, model, mb: Batch, temperature: float, want_entropy: bool, entropy_grad: bool = False,
                      sum_pi2_out: list | None = None, logits_out: list | None = None):
        """Response logprobs [b, T] (and entropy [b, T] or None; with a gradient only if `entropy_grad`).
        With `sum_pi2_out`, sum_v pi(v)^2 per response token [b, T] is appended to it (optimal token baseline);
        with `logits_out`, the temperature-scaled response logits [b, t, V] (t <= T, with the graph) are."""
        T = mb["responses"].shape[1]
        if self._sp is not None:
            return self._sp_logp_entropy(model, mb, temperature, want_entropy, entropy_grad, sum_pi2_out, logits_out)
        if logits_out is None and sum_pi2_out is None:  # from the model's own logits: no fp32 [B, t, V] copy
            parts = self._fused_head(model) if "multi_modal_inputs" not in mb else None
            with self._routing_session(mb):
                if parts is not None:  # the last hidden states: the head runs with the log-probs
                    hidden, rows = packed_response_forward(model, mb["input_ids"], mb["attention_mask"],
                                                           mb["prompts"].shape[1], mb["response_mask"], packed=True,
                                                           device=self.device, decoder=parts[0])
                    t_used = rows.t_used
                else:
                    logits, rows, t_used = self._model_logits(model, mb)
            labels = mb["responses"][:, :t_used]  # (the packed tokens' labels picked on the host: no sync)
            labels = to_device(labels[rows.keep] if rows is not None else labels.reshape(-1), self.device)
            if parts is not None:
                head = parts[1]
                logp, entropy = head_logprobs_and_entropy(hidden, head.weight, head.bias, labels, temperature,
                                                          want_entropy, entropy_grad,
                                                          fp32=isinstance(head, Float32Head))
            else:
                logp, entropy = logprobs_and_entropy(logits, labels, temperature, want_entropy, entropy_grad)
            shape = (len(mb), t_used)

            def place(x):  # [K] or [B * t] -> [B, T]
                return pad_right(scatter_rows(x, rows) if rows is not None else x.view(shape), T)

            return place(logp), (place(entropy) if entropy is not None else None)
        logits, t_used = self._response_logits(model, mb, temperature)
        if logits_out is not None:
            logits_out.append(logits)
        labels = to_device(mb["responses"][:, :t_used], self.device)
        logp = pad_right(logprobs_from_logits(logits, labels), T)
        entropy = None
        if want_entropy:
            entropy = pad_right(entropy_from_logits(logits if entropy_grad else logits.detach()), T)
        if sum_pi2_out is not None:
            sum_pi2_out.append(pad_right(sum_pi_squared_from_logits(logits.detach()), T))
        return logp, entropy

    def _sp_forward(self, model, mb: Batch):
        """This rank's share of the packed forward under sequence parallelism (`ulysses_response_forward`)."""
        return ulysses_response_forward(model, mb["input_ids"], mb["attention_mask"], mb["prompts"].shape[1],
                                        mb["response_mask"], self._sp, device=self.device)  # (packed on the host)

    def _sp_logp_entropy(self, model, mb: Batch, temperature: float, want_entropy: bool, entropy_grad: bool,
                         sum_pi2_out: list | None, logits_out: list | None):
        """`_logp_entropy` under sequence parallelism: log-probs (entropy, sum pi^2) of this rank's slice, gathered
        over the group; the logits of the whole micro-batch are gathered only when `logits_out` asks for them."""
        T = mb["responses"].shape[1]
        local, layout = self._sp_forward(model, mb)
        local = local.float() / temperature  # [k, V]
        labels = layout.local(to_device(mb["responses"][:, :layout.t_used], self.device))
        cols = [logprobs_from_logits(local, labels)]
        if want_entropy:
            cols.append(entropy_from_logits(local if entropy_grad else local.detach()))
        if sum_pi2_out is not None:
            cols.append(sum_pi_squared_from_logits(local.detach()))
        full = layout.gather(torch.stack(cols, dim=-1))  # [B, t, c]
        if logits_out is not None:
            logits_out.append(layout.gather(local))
        if sum_pi2_out is not None:
            sum_pi2_out.append(pad_right(full[..., -1].detach(), T))
        return pad_right(full[..., 0], T), (pad_right(full[..., 1], T) if want_entropy else None)

    @torch.no_grad()
    def _batch_logp(self, model, batch: Batch, micros: MicroBatches, dtype: str,
                    sum_pi2_out: list | None = None) -> torch.Tensor:
        temperature = float(batch.meta.get("temperature", self.rollout_cfg.temperature))
        was_training = model.training
        model.eval()
        pi2_parts: list | None = [] if sum_pi2_out is not None else None
        try:
            with autocast(dtype, self.device):
                parts = [self._logp_entropy(model, mb, temperature, False, sum_pi2_out=pi2_parts)[0]
                         for mb in micros.batches]
        finally:
            model.train(was_training)
        if sum_pi2_out is not None:
            sum_pi2_out.append(micros.restore(pi2_parts).cpu())
        return micros.restore(parts).cpu()

    def compute_log_prob(self, batch: Batch) -> Batch:
        """Behaviour-policy logprobs of the responses: Batch with `old_log_probs[B, T]`."""
        r = self.rollout_cfg
        micros = split_micro_batches(batch, rows=r.log_prob_micro_batch_size_per_gpu,
                                     max_tokens=r.log_prob_max_token_len_per_gpu * self.sp_size
                                     if r.log_prob_use_dynamic_bsz else None,
                                     key="actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
        # the optimal token baseline needs sum_v pi(v)^2 of the same forward (verl: calculate_sum_pi_squared)
        pi2: list | None = [] if "optimal_token_baseline" in self.cfg.algorithm.adv_estimator else None
        # routing replay: R2 records this pass's routing for the update to replay; R3 replays the rollout's
        with self._routing_phase({"R2": "record", "R3": "replay"}.get(self._replay)):
            logp = self._batch_logp(self.model, batch, micros, self.actor_cfg.dtype, sum_pi2_out=pi2)
            recorded = micros.restore(self._recorded) if self._replay == "R2" else None
        return Batch({"old_log_probs": logp, **({"sum_pi_squared": pi2[0]} if pi2 else {}),
                      **({"routed_experts": recorded} if recorded is not None else {})})

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Reference-policy logprobs: Batch with `ref_log_prob[B, T]`."""
        ref = self.cfg.actor_rollout_ref.ref
        micros = split_micro_batches(batch, rows=ref.log_prob_micro_batch_size_per_gpu,
                                     max_tokens=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz
                                     else None, key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu")
        with self._routing_phase("replay" if self._ref_replay == "R3" else None):  # R3: the rollout's routing
            if self.lora:
                with dist_ctx.unwrap_model(self.module).disable_adapter():
                    logp = self._batch_logp(self.model, batch, micros, self.actor_cfg.dtype)
            else:
                if self.ref_module is None:
                    raise RuntimeError("compute_ref_log_prob: the worker was built with need_ref=False")
                logp = self._batch_logp(self.ref_module, batch, micros, self.actor_cfg.dtype)
        return Batch({"ref_log_prob": logp})

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """On-policy distillation: the teacher's logprobs of the student's sampled tokens, `teacher_log_prob[B, T]`
        (the reference's micro-batching and the rollout temperature, like the student's)."""
        ref = self.cfg.actor_rollout_ref.ref
        if not self.teachers:
            raise RuntimeError("compute_teacher_log_prob: no algorithm.distill.teacher_path")

        def score(teacher, rows: Batch) -> torch.Tensor:
            micros = split_micro_batches(rows, rows=ref.log_prob_micro_batch_size_per_gpu,
                                         max_tokens=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz
                                         else None, key="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu")
            return self._batch_logp(teacher, rows, micros, self.actor_cfg.dtype)

        return Batch({"teacher_log_prob": self._by_teacher(batch, score)})

    def _by_teacher(self, batch: Batch, score) -> torch.Tensor:
        """`score(teacher, rows)` -> [b, ...] for each teacher on the rows routed to it (`teacher_index`, several
        teachers), put back in the batch's row order; one teacher scores the whole batch."""
        if len(self.teachers) == 1:
            return score(self.teachers[0], batch)
        if "teacher_index" not in batch:
            raise RuntimeError("several distillation teachers but the batch has no teacher_index (the trainer's "
                               "routing by algorithm.distill.teacher_key)")
        index = batch["teacher_index"]
        out = None
        for k, teacher in enumerate(self.teachers):
            rows = (index == k).nonzero().squeeze(-1).tolist()
            if not rows:
                continue
            part = score(teacher, batch.index(rows))
            if out is None:
                out = part.new_zeros((len(batch), *part.shape[1:]))
            elif part.shape[1] != out.shape[1]:  # (response logits: positions up to the rows' longest response)
                width = max(part.shape[1], out.shape[1])
                part, out = _pad_positions(part, width), _pad_positions(out, width)
            out[torch.tensor(rows, device=out.device)] = part
        return out

    # ------------------------------------------------------------------------------ PRIME's implicit PRM
    def update_prm(self, batch: Batch) -> dict[str, float]:
        """PRIME: one pass of the implicit PRM's update on the step's samples and outcome labels (`acc`)."""
        return self.prm.update(batch, self._logp_entropy)

    def compute_prm_log_ratio(self, batch: Batch) -> Batch:
        """PRIME: `prm_q[B, T]` = log pi_prm - log pi_ref of the response tokens, with the PRM as it is now."""
        return self.prm.log_ratio(batch, self._batch_logp)

    # --------------------------------------------------------------------------------- update
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO-style update on `batch` (see module docstring); returns `actor/...` metrics.

        batch tensors: input_ids, attention_mask, prompts, responses, response_mask, advantages[B, T];
        optional old_log_probs (else on-policy: the detached current logprobs) and ref_log_prob (KL loss).
        meta: `mini_batch_size` (samples per mini-batch on this rank), `temperature`, `global_step`,
        `entropy_coeff` (overrides the config's, for adaptive entropy).
        """
        a = self.actor_cfg
        mini = int(batch.meta.get("mini_batch_size", len(batch)))
        entropy_coeff = float(batch.meta.get("entropy_coeff", a.entropy_coeff))
        stats: dict[str, list[float]] = {}
        # on-policy (no old_log_probs): the mismatch is measured on the update's own logprobs
        # (asynchronous RL: also when the old logprobs are the rollout's own, meta `measure_mismatch`)
        measure = batch.meta.get("measure_mismatch", "old_log_probs" not in batch)
        self._mismatch_parts = [] if measure and "rollout_log_probs" in batch else None
        mismatch = {}
        self.model.train()
        shuffle_seed = (self.cfg.trainer.seed * 100_003 + int(batch.meta.get("global_step", 0)) * 31
                        if a.shuffle else None)
        # routing replay: R3 replays the rollout's routing; R2 the old-logprob pass's (none: the update's own routing
        # is the old policy's, on-policy)
        replay = self._replay == "R3" or (self._replay == "R2" and "routed_experts" in batch)
        with self._routing_phase("replay" if replay else None):
            for data in epoch_passes(batch, a.ppo_epochs, shuffle_seed):
                for mb in data.split(mini):
                    for k, v in self._update_mini_batch(mb, entropy_coeff).items():
                        stats.setdefault(k, []).append(v)
                if self._mismatch_parts is not None:  # after the first epoch (on-policy: the only one)
                    mismatch = self._global_mismatch(self._mismatch_parts)
                    self._mismatch_parts = None
        self.scheduler.step()
        metrics = {(k if k.startswith("distillation/") else f"actor/{k}"): _mean(v) for k, v in stats.items()}
        if replay:  # the share of (token, layer) routes where the policy itself chose the replayed experts
            routed, agreed = dist_ctx.all_reduce_sum(torch.stack(self._routing_stats).sum(0).double()) \
                if dist_ctx.is_distributed() else torch.stack(self._routing_stats).sum(0)
            metrics["actor/router_replay_agreement"] = float(agreed) / max(float(routed), 1.0)
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics.update({f"training/{k}": v for k, v in read_metrics(mismatch).items()})
        return metrics

    @staticmethod
    def _global_mismatch(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Mismatch metrics over this rank's parts and, under torch.distributed, every rank's."""
        sums = merge_mismatch_sums(parts) if parts else mismatch_sums(torch.zeros(0, 0), torch.zeros(0, 0),
                                                                      torch.zeros(0, 0))
        if dist_ctx.is_distributed():
            total = dist_ctx.all_reduce_sum(torch.stack([sums[k] for k in MISMATCH_SUM_KEYS]))
            sums.update(zip(MISMATCH_SUM_KEYS, total.unbind()))
            sums["diff_max"] = torch.tensor(max(dist_ctx.all_gather_object(float(sums["diff_max"]))),
                                            dtype=torch.float64)
        return mismatch_metrics(sums)

    def _update_mini_batch(self, mb: Batch, entropy_coeff: float) -> dict[str, float]:
        a = self.actor_cfg
        loss_mode = a.policy_loss.loss_mode
        hyper = dict(clip_ratio=a.clip_ratio, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                     clip_ratio_c=a.clip_ratio_c, clip_cov_ratio=a.policy_loss.clip_cov_ratio,
                     clip_cov_lb=a.policy_loss.clip_cov_lb, clip_cov_ub=a.policy_loss.clip_cov_ub,
                     kl_cov_ratio=a.policy_loss.kl_cov_ratio, ppo_kl_coef=a.policy_loss.ppo_kl_coef,
                     tau_pos=a.tau_pos, tau_neg=a.tau_neg, dro_beta=a.policy_loss.dro_beta)
        if loss_mode == "vespo":
            pl = a.policy_loss
            hyper.update(vespo_k_pos=pl.vespo_k_pos, vespo_lambda_pos=pl.vespo_lambda_pos,
                         vespo_k_neg=pl.vespo_k_neg, vespo_lambda_neg=pl.vespo_lambda_neg)
        rc = self.cfg.algorithm.rollout_correction
        if rc.bypass_mode:  # verl's apply_bypass_mode: old logprobs = rollout logprobs, correction inside the loss
            loss_mode = "bypass_mode"
            hyper = dict(clip_ratio=a.clip_ratio, clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
                         clip_ratio_c=a.clip_ratio_c, loss_type=rc.loss_type, rollout_is=rc.rollout_is,
                         rollout_is_threshold=rc.rollout_is_threshold,
                         rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
                         rollout_rs_threshold=rc.rollout_rs_threshold)
        policy_loss = get_policy_loss(loss_mode)
        pg_agg_mode = FORCED_LOSS_AGG_MODE.get(loss_mode, a.loss_agg_mode)  # verl forces it for the pg term only
        agg_mode = a.loss_agg_mode  # entropy, KL loss and distillation: the config's (verl's ppo_loss, the same)
        agg = global_counts(mb, a.loss_scale_factor)
        n_tok = agg["global_tokens"]
        temperature = float(mb.meta.get("temperature", self.rollout_cfg.temperature))
        full_vocab = self.cfg.algorithm.distill.loss_mode in FULL_VOCAB_LOSS_MODES and "teacher_log_prob" in mb
        self.optimizer.zero_grad(set_to_none=True)
        lanes, threads = lane_plan(a.update_lanes, self._lent_lanes, self._lane_threads)
        micros = split_micro_batches(mb, rows=lane_rows(len(mb), a.ppo_micro_batch_size_per_gpu, lanes),
                                     max_tokens=a.ppo_max_token_len_per_gpu * self.sp_size if a.use_dynamic_bsz
                                     else None,
                                     key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu").batches

        def micro_step(i: int, micro: Batch) -> tuple[dict, dict | None]:
            self._poll()
            part: dict = {}  # metric -> a device scalar (or a float)
            dist_ctx.set_grad_sync(self.model, i == len(micros) - 1)  # reduce once, after the last
            mask = to_device(micro["response_mask"], self.device).float()
            logits_out = [] if full_vocab else None  # gjsd: the student's logits, for the teacher's distribution
            aux_sink = self._router_aux.collect() if self._router_aux is not None else contextlib.nullcontext()
            with autocast(a.dtype, self.device), aux_sink as routed:
                logp, entropy = self._logp_entropy(self.model, micro, temperature, True, entropy_coeff != 0.0,
                                                   logits_out=logits_out)
            old = to_device(micro["old_log_probs"], self.device) if "old_log_probs" in micro else logp.detach()
            mismatch = None
            if self._mismatch_parts is not None:
                mismatch = mismatch_sums(logp.detach(), to_device(micro["rollout_log_probs"], self.device), mask)
            adv = to_device(micro["advantages"], self.device)
            is_weights = (to_device(micro["rollout_is_weights"], self.device).to(logp.dtype)
                          if "rollout_is_weights" in micro else None)
            inside = {"rollout_is_weights": is_weights} if loss_mode in IS_WEIGHTS_INSIDE and is_weights is not None \
                else {}
            pg_tok, pg_metrics = policy_loss(logp, old, adv, mask, **hyper, **inside)
            bonus_mask = mask
            if a.top_entropy_quantile < 1.0:  # only the high-entropy ("forking") tokens learn (TRL's 80/20 option)
                bonus_mask = mask * high_entropy_mask(entropy, mask, a.top_entropy_quantile)
                pg_tok = pg_tok * bonus_mask
                part["entropy_mask_frac"] = bonus_mask.sum() / max(n_tok, 1.0)
            if a.off_policy_mask_threshold is not None:  # OPSM: far-off-policy negative samples leave the gradient
                behaviour = to_device(micro["rollout_log_probs"], self.device) if "rollout_log_probs" in micro else old
                keep = off_policy_sequence_mask(adv, logp, behaviour, mask, a.off_policy_mask_threshold)
                pg_tok = pg_tok * keep
                part["opsm_dropped_frac"] = ((1 - keep) * mask).sum() / max(n_tok, 1.0)
            if is_weights is not None and not inside:  # TIS: constant per-token weights on the policy gradient
                pg_tok = pg_tok * rollout_is_weights_for(loss_mode, is_weights.to(pg_tok.dtype), mask)
            pg_mask = bypass_loss_mask(logp, old, mask, **hyper) if loss_mode == "bypass_mode" else mask  # verl's
            pg_loss = aggregate_loss(pg_tok, pg_mask, pg_agg_mode, **agg)
            loss = pg_loss
            if "teacher_log_prob" in micro:  # on-policy distillation (tiller.algos.distill)
                if full_vocab:
                    loss = self._add_full_vocab_distillation(loss, logp, logits_out[0], micro, mask, temperature,
                                                             agg_mode, agg, part)
                else:
                    loss = self._add_distillation(loss, logp, old, micro, mask, agg_mode, agg, part)
            ent = aggregate_loss(entropy, mask, "token-mean", global_tokens=n_tok)
            if entropy_coeff != 0.0:  # (with top_entropy_quantile: over the kept tokens, as TRL)
                loss = loss - entropy_coeff * aggregate_loss(entropy, bonus_mask, a.entropy_agg_mode or agg_mode, **agg)
            if a.use_kl_loss:
                kl = kl_penalty(logp, to_device(micro["ref_log_prob"], self.device), a.kl_loss_type)
                if a.kl_loss_importance_weight:  # DeepSeek-V3.2's unbiased estimate (TRL: use_bias_correction_kl)
                    kl = importance_weighted_kl(kl, logp, old, mask, "sequence" if loss_mode == "gspo" else "token")
                kl_loss = aggregate_loss(kl, mask, agg_mode, **agg)
                loss = loss + a.kl_loss_coef * kl_loss
                part["kl_loss"] = kl_loss.detach()
            if routed is not None:  # the MoE router's balance, this micro-batch's by its share of the sequences
                share = counted_rows(micro) / max(agg["global_seqs"], 1.0)
                aux = micro_batch_aux(routed)
                loss = loss + a.router_aux_loss_coef * share * aux
                part["aux_loss"] = share * aux.detach()
            loss.backward()
            # metrics stay on the device (0-dim tensors), read once after the last micro-batch (`read_metrics`)
            w = mask.sum() / max(n_tok, 1.0)  # token share of this micro-batch, for metric means
            part["pg_loss"] = pg_loss.detach()
            part["entropy"] = ent.detach()
            for k, v in pg_metrics.items():
                if loss_mode == "bypass_mode" and k not in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):  # its
                    # correction's metrics (vespo's vespo_phi_mean stays actor/)
                    k = f"rollout_corr/{k}"
                part[k] = w * (v.detach() if isinstance(v, torch.Tensor) else v)
            return part, mismatch

        self._in_lanes = lanes > 1 and len(micros) > 1  # each lane keeps its thread count: no borrowing polls
        try:
            parts = run_in_lanes(micro_step, micros, lanes, threads)
        finally:
            self._in_lanes = False
        for _, mismatch in parts:  # in micro-batch order
            if mismatch is not None:
                self._mismatch_parts.append(mismatch)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
        # the update's one host read: its metrics and the gradient norm (whether to step on it)
        sums, grad_norm = read_update_metrics((part for part, _ in parts), grad_norm)
        if np.isfinite(grad_norm):
            self.optimizer.step()
        else:
            sums["grad_norm_nonfinite"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        if self._ref_sync is not None:  # (TRL's SyncRefModelCallback, after every optimizer step)
            self._ref_sync.after_optimizer_step(self.ref_module, dist_ctx.unwrap_model(self.module))
        if dist_ctx.is_distributed():  # the sums above are this rank's share of global means
            keys = sorted(k for k in sums if k != "grad_norm_nonfinite")
            total = dist_ctx.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
            sums.update(zip(keys, total.tolist()))
        sums["grad_norm"] = grad_norm
        return sums

    def _add_distillation(self, pg_loss, logp, old, micro, mask, agg_mode, agg, sums):
        """pg_loss -> outcome_coef * pg_loss + coef * distill (with the outcome reward), or distill alone
        (verl's use_task_rewards); `distillation/*` sums (token-weighted means over the mini-batch)."""
        d, a = self.cfg.algorithm.distill, self.actor_cfg
        tok, metrics = distillation_loss(
            logp, old, to_device(micro["teacher_log_prob"], self.device), mask, loss_mode=d.loss_mode,
            use_policy_gradient=d.use_policy_gradient, log_prob_min_clamp=d.log_prob_min_clamp,
            loss_max_clamp=d.loss_max_clamp, clip_ratio=a.clip_ratio,
            clip_ratio_low=d.clip_ratio_low if d.clip_ratio_low is not None else a.clip_ratio_low,
            clip_ratio_high=d.clip_ratio_high if d.clip_ratio_high is not None else a.clip_ratio_high,
            clip_ratio_c=3.0,  # verl: DistillationLossConfig has no clip_ratio_c, its vanilla loss falls back to 3.0
            rollout_is_weights=(to_device(micro["rollout_is_weights"], self.device) if "rollout_is_weights" in micro
                                else None))
        distill = aggregate_loss(tok, mask, agg_mode, **agg)
        return self._distill_total(pg_loss, distill, metrics, mask, agg, sums)

    def _add_full_vocab_distillation(self, pg_loss, logp, logits, micro, mask, temperature, agg_mode, agg, sums):
        """loss_mode=gjsd: the teacher's logits at the same response positions (its forward here, per micro-batch,
        so no [B, T, V] tensor is ever stored in the batch), the generalized JSD against the student's `logits`
        [b, t, V] (`tiller.algos.distill.gjsd_loss`, chunked over positions), combined as `_add_distillation`."""
        d = self.cfg.algorithm.distill
        with torch.no_grad(), autocast(self.actor_cfg.dtype, self.device):  # the teachers stay in eval mode
            teacher_logits = self._by_teacher(micro, lambda teacher, rows: self._response_logits(
                teacher, rows, temperature)[0])
        t_used = teacher_logits.shape[1]
        if teacher_logits.shape != logits.shape:
            raise ConfigError(f"algorithm.distill.teacher_path={d.teacher_path}: the teacher's logits "
                              f"{tuple(teacher_logits.shape)} differ from the student's {tuple(logits.shape)} "
                              "(loss_mode=gjsd needs the same vocabulary size)")
        tok, metrics = gjsd_loss(logits, teacher_logits, mask[:, :t_used], beta=d.beta, temperature=1.0)
        tok = pad_right(tok, mask.shape[1])  # logits are already divided by the temperature
        distill = aggregate_loss(tok, mask, agg_mode, **agg)
        metrics["reverse_kl"] = masked_mean((logp - to_device(micro["teacher_log_prob"], self.device)).detach(), mask)
        return self._distill_total(pg_loss, distill, metrics, mask, agg, sums)

    def _distill_total(self, pg_loss, distill, metrics, mask, agg, sums):
        """The micro-batch's distillation metrics into `sums` (token-weighted), and its loss: the distillation
        loss alone, or beside the outcome reward's policy loss (verl's use_task_rewards)."""
        d = self.cfg.algorithm.distill
        share = mask.sum() / max(agg["global_tokens"], 1.0)  # (device scalars: read once, `read_metrics`)
        sums["distillation/loss"] = sums.get("distillation/loss", 0.0) + distill.detach()
        for k, v in metrics.items():
            sums[f"distillation/{k}"] = sums.get(f"distillation/{k}", 0.0) + share * (
                v.detach() if isinstance(v, torch.Tensor) else v)
        if d.use_outcome_reward:
            return d.outcome_coef * pg_loss + d.coef * distill
        return distill

    # --------------------------------------------------------------------------- checkpoints
    def _files_saver(self):
        """What writes the checkpoint's tokenizer files: a vision-language model's processor (tokenizer + image
        processor config), so the checkpoint's model dir loads back as a VLM; else the tokenizer."""
        if not self.vision:
            return self.tokenizer
        if getattr(self, "_processor", None) is None:
            m = self.cfg.actor_rollout_ref.model
            self._processor = load_processor(m.path, tokenizer=self.tokenizer, trust_remote_code=m.trust_remote_code)
            set_chat_template(self.tokenizer, m.custom_chat_template, self._processor)
        return self._processor

    def save_checkpoint(self, ckpt_root: str, step: int, extra_state: dict, keep: int | None = None) -> str:
        """Atomic checkpoint of model, optimizer, schedule, tokenizer and the driver's `extra_state`."""
        path, model = None, dist_ctx.unwrap_model(self.module)
        optimizer = dist_ctx.checkpointable_optimizer(self.model, self.optimizer)  # collective under FSDP2
        if self._rollout_is_copy:  # FSDP2: save the unsharded copy, synced to the shards
            self._refresh_copy(dist_ctx.full_state_dict(self.model))
            model = self.rollout_module
        if dist_ctx.rank() == 0:
            path = save_checkpoint(ckpt_root, step, model=model, optimizer=optimizer, scheduler=self.scheduler,
                                   extra_state={**extra_state, **self._ref_sync_state()},
                                   tokenizer=self._files_saver(), keep=keep, **self._prm_state())
        dist_ctx.barrier()
        return str(path)

    def _prm_state(self) -> dict:
        """PRIME: the implicit PRM and its optimizer travel with the actor's checkpoint (`prm/`, `prm_optimizer.pt`);
        a reference that follows the policy (ref.ref_model_sync_steps) travels as `ref/`."""
        parts = {} if self.prm is None else self.prm.checkpoint_parts()
        if self._ref_sync is not None:
            parts["extra_models"] = {**parts.get("extra_models", {}), "ref": self.ref_module}
        return parts

    def _ref_sync_state(self) -> dict:
        return {} if self._ref_sync is None else {"ref_sync_optimizer_steps": self._ref_sync.optimizer_steps}

    def _restore_ref_sync(self, state: dict) -> dict:
        if self._ref_sync is not None:
            self._ref_sync.optimizer_steps = int(state.get("ref_sync_optimizer_steps", 0))
        return state

    def load_checkpoint(self, path: str) -> dict:
        """Restore model, optimizer and schedule; returns the driver's extra_state (with `step`)."""
        if not self._rollout_is_copy:
            state = load_checkpoint(path, model=dist_ctx.unwrap_model(self.module), optimizer=self.optimizer,
                                    scheduler=self.scheduler, **self._prm_state())
            self.sync_rollout_weights()
            return self._restore_ref_sync(state)
        # FSDP2: read the full weights into the unsharded copy, then scatter them into the shards
        state = load_checkpoint(path, model=self.rollout_module, scheduler=self.scheduler,
                                optimizer=dist_ctx.FullOptimizerState(self.model, self.optimizer), **self._prm_state())
        dist_ctx.load_full_state_dict(self.model, self.rollout_module.state_dict())
        if self.rollout_cfg.name == "vllm":
            self.sync_rollout_weights()
        elif self._rollout is not None:
            self._rollout.update_weights()
        return self._restore_ref_sync(state)

    def _refresh_copy(self, state: dict[str, torch.Tensor]) -> None:
        """Load full weights into the unsharded copy (through the in-process engine, which shares it)."""
        if self.rollout_cfg.name == "vllm" or self._rollout is None:
            self.rollout_module.load_state_dict(state)
        else:
            self._rollout.update_weights(state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (gathered) actor weights on the CPU (for tests and export)."""
        return {k: v.clone() for k, v in dist_ctx.full_state_dict(self.model).items()}


class _ToolLoopEngine:
    """A rollout engine whose samples are multi-turn tool conversations (`tiller.rollout.agent.AgentLoop` over
    `engine`): `generate(prompt_ids, sampling)` -> `AgentRolloutOutput`, the whole response (model and tool tokens)
    bounded by `sampling.max_new_tokens`, as tiller eval bounds it."""

    def __init__(self, loop, engine, tokenizer):
        self.loop, self.engine, self.tokenizer = loop, engine, tokenizer

    def generate(self, prompt_ids, sampling, tools_kwargs=None, weights_hook=None, multi_modal=None,
                 single_turn=None, rows=None):
        more = {"rows": rows} if rows is not None else {}
        return self.loop.generate(self.engine, self.tokenizer, [list(p) for p in prompt_ids], sampling,
                                  max_response_length=sampling.max_new_tokens, tools_kwargs=tools_kwargs,
                                  weights_hook=weights_hook, multi_modal=multi_modal, single_turn=single_turn,
                                  **more)


def _pad_positions(x: torch.Tensor, width: int) -> torch.Tensor:
    """[b, t, ...] -> [b, width, ...], zeros after t."""
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, width - x.shape[1]])
