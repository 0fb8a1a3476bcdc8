"""CriticWorker: the value model V(s_t) for PPO's GAE (Schulman et al. 2015, 2017; verl's dp_critic).

The value model is `AutoModelForTokenClassification(num_labels=1)` loaded from the critic path (default:
the actor's model dir), so it starts from the policy's transformer with a fresh scalar head, as in verl.
`compute_values` returns V at every response position (the state before each response token);
A vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL: no token-classification class in transformers) is the same
architecture with its LM head replaced by a fresh scalar head (`vision_value_model`), and its forwards take each
row's `pixel_values` / `image_grid_thw` with the model's M-RoPE positions, as the actor's do.
`update_critic` regresses them on the GAE returns with verl's clipped value loss
    L = 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2),
aggregated with global counts over `ppo_epochs` x mini-batches x micro-batches, grad clipping and AdamW.

With LoRA (`critic.model.lora_rank > 0` or `critic.model.lora_adapter_path`, as verl's FSDP critic) the body gets
adapters and the scalar head trains in full (peft TOKEN_CLS: `tiller.models.lora`); the optimizer holds those only,
and checkpoints hold the adapter with the head (`tiller export` merges them into the base). A vision-language
critic trains in full (LoRA refused: its value head replaces the LM head, which an adapter cannot merge back into).

Letters: `B` samples, `T` response width.
"""

from __future__ import annotations

import numpy as np
import torch

from tiller.algos.aggregate import aggregate_loss
from tiller.algos.value_loss import explained_variance, value_loss
from tiller.distributed import context as dist_ctx
from tiller.errors import ConfigError, UserError
from tiller.models.checkpoint import load_checkpoint, save_checkpoint
from tiller.models.loading import is_vision_checkpoint, model_config as hf_model_config
from tiller.models.lora import attach_lora, lora_enabled
from tiller.models.quant import bnb_config, quantize_after_load
from tiller.models.quiet import fresh_head
from tiller.models.vision import is_vision_model
from tiller.protocol import Batch, to_device
from tiller.workers.common import (
    autocast,
    read_update_metrics,
    build_optimizer,
    build_scheduler,
    epoch_passes,
    forward_options,
    global_counts,
    lane_plan,
    pad_right,
    prepare_process,
    refuse_lanes_under_distributed,
    response_forward,
    run_in_lanes,
)
from tiller.workers.micro_batches import lane_rows, split_micro_batches
from tiller.models.layer_masks import has_recurrent_layers, text_config
from tiller.workers.packed import enable_checkpointing, packed_response_forward, packs
from tiller.workers.ulysses import check_heads, seq_parallel_groups, ulysses_response_forward


class CriticWorker:
    """Value model + optimizer (see module docstring)."""

    def __init__(self, config, total_training_steps: int):
        from transformers import AutoModelForTokenClassification

        self.cfg = config
        self.ccfg = config.critic
        self._lent_lanes, self._lane_threads = 0, None  # set_lent_lanes
        refuse_lanes_under_distributed("critic.update_lanes", self.ccfg.update_lanes)
        prepare_process(config.trainer)
        # fresh heads / LoRA weights initialise the same in-process and in every Ray rank
        torch.manual_seed(config.trainer.seed)
        self.device = torch.device(config.trainer.device)
        path = self.ccfg.model.path or config.actor_rollout_ref.model.path
        try:
            # no dropout on the value head (as verl): per-rank dropout masks would also break the
            # "N ranks == 1 process" equivalence
            trust = self.ccfg.model.trust_remote_code
            model_config = hf_model_config(path, self.ccfg.model.override_config, trust_remote_code=trust,
                                           key="critic.model.override_config", num_labels=1)
            model_config.classifier_dropout = 0.0
            attn = self.ccfg.model.override_config.get("attn_implementation")
            kwargs = dict(config=model_config, dtype=torch.float32, trust_remote_code=trust,
                          **({"attn_implementation": attn} if attn else {}))
            quant = bnb_config(self.ccfg.model, torch.float32, keep=("score", "classifier"))  # QLoRA: a 4-bit body
            if quant is not None and is_vision_checkpoint(path):
                raise ConfigError("critic.model.load_in_4bit=true: a vision-language critic trains in full (no LoRA "
                                  "on it), so its body cannot be 4-bit")
            if is_vision_checkpoint(path):
                module = vision_value_model(path, **kwargs)
            else:
                with fresh_head():  # a policy checkpoint has no value head: the fresh one is expected
                    module = AutoModelForTokenClassification.from_pretrained(
                        path, **kwargs, **({"quantization_config": quant} if quant is not None else {}))
                if quant is not None:
                    module = quantize_after_load(module)
        except (OSError, ValueError) as err:
            raise UserError(f"critic.model.path: cannot load a value model from {path!r}: {err}") from err
        # a Qwen3-VL config keeps its token ids in text_config only (no top-level pad / eos attribute)
        config = module.config
        if getattr(config, "pad_token_id", None) is None and getattr(config, "eos_token_id", None) is not None:
            config.pad_token_id = config.eos_token_id
        # LoRA (verl's critic.model.lora_rank / lora_adapter_path): adapters on the body, the value head in full
        self.lora = lora_enabled(self.ccfg.model)
        if self.lora and is_vision_model(module):
            raise ConfigError("critic.model.lora_rank / critic.model.lora_adapter_path: LoRA on a vision-language "
                              f"critic ({type(module).__name__}) is not supported; train it in full (lora_rank=0)")
        module = attach_lora(module, self.ccfg.model, "critic.model")
        # verl's critic.model.use_remove_padding: each micro-batch's rows packed into one sequence (as the actor's)
        self._remove_padding = packs(module, "critic.model.use_remove_padding",
                                     bool(self.ccfg.model.use_remove_padding) and not is_vision_model(module))
        if self.ccfg.model.enable_gradient_checkpointing:
            if self._remove_padding:
                enable_checkpointing(module)  # its recompute keeps the packed forward's attention
            else:
                module.gradient_checkpointing_enable()
        module.to(self.device).train()
        self.module = module
        self._forward_opts = forward_options(module, self.ccfg.share_prompt_forward)
        # Ulysses sequence parallelism (critic.ulysses_sequence_parallel_size): as the actor's (tiller.workers.ulysses)
        self._sp = self._seq_parallel(module) if dist_ctx.is_distributed() else None
        self.sp_size = self._sp.size if self._sp is not None else 1
        strategy = self.ccfg.strategy.replace("fsdp2", "fsdp")
        # FSDP2 shards in place: checkpoints are written from an unsharded CPU copy (filled at save time)
        self.full_module = None
        if strategy == "fsdp" and dist_ctx.is_distributed():
            import copy

            self.full_module = copy.deepcopy(module).to("cpu").requires_grad_(False)
        self.model = dist_ctx.wrap_model(module, strategy=strategy)
        self.optimizer = build_optimizer(self.model, self.ccfg.optim, "critic.optim")
        self.scheduler = build_scheduler(self.optimizer, self.ccfg.optim, total_training_steps)

    def _seq_parallel(self, module):
        """The sequence-parallel group of critic.ulysses_sequence_parallel_size (> 1), its requirements checked."""
        size = int(self.ccfg.ulysses_sequence_parallel_size or 1)
        if size <= 1:
            return None
        if has_recurrent_layers(module):
            raise ConfigError(f"critic.ulysses_sequence_parallel_size={size}: "
                              f"{text_config(module.config).model_type}'s recurrent layers carry a state along the "
                              "sequence, which is not split over ranks; set it to 1")
        if not self._remove_padding:
            raise ConfigError(f"critic.ulysses_sequence_parallel_size={size} splits the packed sequence: set "
                              "critic.model.use_remove_padding=True (a vision-language critic is not split)")
        check_heads(module.config, size, key=f"critic.ulysses_sequence_parallel_size={size}")
        return seq_parallel_groups(size, key="critic.ulysses_sequence_parallel_size")

    def parallel_layout(self) -> dict[str, int]:
        """This rank's place: `rank`, `world`, `sp` (sequence-parallel group size), `sp_rank` (place in it)."""
        return {"rank": dist_ctx.rank(), "world": dist_ctx.world_size(), "sp": self.sp_size,
                "sp_rank": self._sp.rank if self._sp is not None else 0}

    def _values(self, mb: Batch) -> torch.Tensor:
        P, T = mb["prompts"].shape[1], mb["responses"].shape[1]
        mm = list(mb["multi_modal_inputs"]) if "multi_modal_inputs" in mb else None  # image prompts: their pixels
        rmask = to_device(mb["response_mask"], self.device)
        if self._sp is not None:
            local, layout = ulysses_response_forward(self.model, mb["input_ids"], mb["attention_mask"], P,
                                                     mb["response_mask"], self._sp, logits_to_keep=False,
                                                     device=self.device)  # (packed on the host)
            out = layout.gather(local.float())
        elif self._remove_padding and mm is None:
            out, _ = packed_response_forward(self.model, mb["input_ids"], mb["attention_mask"], P, mb["response_mask"],
                                             logits_to_keep=False, device=self.device)  # packed on the host
        else:
            out, _ = response_forward(self.model, mb["input_ids"], mb["attention_mask"], P, mb["response_mask"],
                                      multi_modal=mm, device=self.device, **self._forward_opts)  # trimmed on the host
        return pad_right(out.squeeze(-1).float(), T) * rmask

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """Batch with `values[B, T]` (0 outside the response mask)."""
        c = self.ccfg
        micros = split_micro_batches(batch, rows=c.forward_micro_batch_size_per_gpu,
                                     max_tokens=c.forward_max_token_len_per_gpu * self.sp_size
                                     if c.use_dynamic_bsz else None,
                                     key="critic.forward_max_token_len_per_gpu")
        self.model.eval()
        with autocast(c.dtype, self.device, key="critic.dtype"):
            parts = [self._values(mb) for mb in micros.batches]
        self.model.train()
        return Batch({"values": micros.restore(parts).cpu()})

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Fit V to `returns[B, T]` (batch also holds `values` from collection time); `critic/...` metrics.

        meta: `critic_mini_batch_size` (samples per mini-batch on this rank), `ppo_epochs`, `global_step`
        (seeds `critic.shuffle`).
        """
        mini = int(batch.meta.get("critic_mini_batch_size", len(batch)))
        epochs = int(batch.meta.get("ppo_epochs", 1))
        stats: dict[str, list[float]] = {}
        # seeded per step and epoch, like the actor's (its own stream)
        shuffle_seed = (self.cfg.trainer.seed * 100_019 + int(batch.meta.get("global_step", 0)) * 31
                        if self.ccfg.shuffle else None)
        for data in epoch_passes(batch, epochs, shuffle_seed):
            for mb in data.split(mini):
                for k, v in self._update_mini_batch(mb).items():
                    stats.setdefault(k, []).append(v)
        self.scheduler.step()
        metrics = {f"critic/{k}": float(np.mean(v)) for k, v in stats.items()}
        metrics["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return metrics

    def set_lent_lanes(self, lanes: int = 0, threads: int = 1) -> None:
        """Asynchronous RL in one process: `lanes` more update lanes on `threads` torch threads each (0: none)."""
        self._lent_lanes, self._lane_threads = max(0, lanes), max(1, threads)

    def _update_mini_batch(self, mb: Batch) -> dict[str, float]:
        c = self.ccfg
        agg = global_counts(mb, c.loss_scale_factor)
        self.optimizer.zero_grad(set_to_none=True)
        lanes, threads = lane_plan(c.update_lanes, self._lent_lanes, self._lane_threads)
        micros = split_micro_batches(mb, rows=lane_rows(len(mb), c.ppo_micro_batch_size_per_gpu, lanes),
                                     max_tokens=c.ppo_max_token_len_per_gpu * self.sp_size if c.use_dynamic_bsz
                                     else None,
                                     key="critic.ppo_max_token_len_per_gpu").batches

        def micro_step(i: int, micro: Batch) -> tuple[torch.Tensor, ...]:
            dist_ctx.set_grad_sync(self.model, i == len(micros) - 1)  # reduce once, after the last
            mask = to_device(micro["response_mask"], self.device).float()
            with autocast(c.dtype, self.device, key="critic.dtype"):
                vpreds = self._values(micro)
            tok_loss, m = value_loss(vpreds, to_device(micro["returns"], self.device),
                                     to_device(micro["values"], self.device), mask, c.cliprange_value)
            loss = aggregate_loss(tok_loss, mask, c.loss_agg_mode, **agg)
            loss.backward()
            w = mask.sum() / max(agg["global_tokens"], 1.0)  # (device scalars, read once: `read_metrics`)
            return loss.detach(), w * m["vf_clipfrac"].detach(), w * m["vpred_mean"].detach()

        parts = run_in_lanes(micro_step, micros, lanes, threads)  # (in micro-batch order)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        # the update's one host read: its metrics and the gradient norm (whether to step on it)
        sums, grad_norm = read_update_metrics((dict(zip(("vf_loss", "vf_clipfrac", "vpred_mean"), part))
                                               for part in parts), grad_norm)
        if np.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if dist_ctx.is_distributed():  # the sums above are this rank's share of global means
            keys = sorted(sums)
            total = dist_ctx.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
            sums.update(zip(keys, total.tolist()))
        sums["grad_norm"] = grad_norm
        return sums

    def save_checkpoint(self, ckpt_root: str, step: int, keep: int | None = None) -> str:
        path, model = None, dist_ctx.unwrap_model(self.module)
        optimizer = dist_ctx.checkpointable_optimizer(self.model, self.optimizer)  # collective under FSDP2
        if self.full_module is not None:
            self.full_module.load_state_dict(dist_ctx.full_state_dict(self.model))
            model = self.full_module
        if dist_ctx.rank() == 0:
            path = save_checkpoint(ckpt_root, step, model=model, optimizer=optimizer, scheduler=self.scheduler,
                                   keep=keep)
        dist_ctx.barrier()
        return str(path)

    def load_checkpoint(self, path: str) -> dict:
        if self.full_module is None:
            return load_checkpoint(path, model=dist_ctx.unwrap_model(self.module), optimizer=self.optimizer,
                                   scheduler=self.scheduler, restore_rng=False)
        state = load_checkpoint(path, model=self.full_module, scheduler=self.scheduler, restore_rng=False,
                                optimizer=dist_ctx.FullOptimizerState(self.model, self.optimizer))
        dist_ctx.load_full_state_dict(self.model, self.full_module.state_dict())
        return state


def vision_value_model(path: str, config, **kwargs) -> torch.nn.Module:
    """A vision-language model as a value model: `AutoModelForImageTextToText` with `lm_head` replaced by a fresh
    `Linear(hidden, 1)` (initialised as transformers' token-classification head: weight ~ N(0, initializer_range),
    bias 0; word embeddings untied from it), so its forward returns `logits [B, L, 1]` = V(s_t) and takes
    `pixel_values` / `image_grid_thw` / M-RoPE `position_ids` like the policy."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, config=config, **kwargs)
    text = getattr(model.config, "text_config", model.config)
    head = torch.nn.Linear(text.hidden_size, 1, bias=True, dtype=model.lm_head.weight.dtype)
    torch.nn.init.normal_(head.weight, std=getattr(text, "initializer_range", 0.02))
    torch.nn.init.zeros_(head.bias)
    model.lm_head = head
    for cfg in {id(model.config): model.config, id(text): text}.values():
        cfg.tie_word_embeddings = False  # save / load the head as its own weight, never re-tied to the embeddings
    return model


def value_metrics(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's critic/values/* and critic/vf_explained_var over the batch."""
    m = mask.bool()
    v = values[m]
    return {
        "critic/values/mean": float(v.mean()) if v.numel() else 0.0,
        "critic/values/max": float(v.max()) if v.numel() else 0.0,
        "critic/values/min": float(v.min()) if v.numel() else 0.0,
        "critic/vf_explained_var": float(explained_variance(values, returns, mask)),
    }
