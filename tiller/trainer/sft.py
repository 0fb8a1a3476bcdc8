"""`tiller sft`: supervised fine-tuning with loss on response tokens only.

Loss: the mean negative log-likelihood of the response tokens of the whole optimizer step,
    L = - sum_{i, t in response_i} log pi(y_t | y_<t) / N_tok,   N_tok = response tokens in the step,
(`algorithm.loss=dft`: each token's term scaled by its detached probability, `tiller.algos.sft_token_loss`)
so every response token of the step weighs the same however the step is split into micro-batches or
packed into rows (global token-mean, `tiller.algos.aggregate_loss(..., "token-mean", global_tokens=)`).
Validation reports the same token-mean `val/loss` over the whole validation set and
`val/perplexity = exp(val/loss)`.

Data: `tiller.data.sft` (prompt / response or chat messages, every assistant turn learned); a
vision-language model (Qwen2-VL / Qwen2.5-VL / Qwen3-VL) also learns from image + text conversations
(`tiller.data.sft_vision`: the pixels and M-RoPE positions go through the forward, the saved model dir
carries the processor config, so `AutoProcessor` and `tiller rl` load it back);
packing: `tiller.data.packing` (`data.packing=True`). Deviation from verl's SFT trainer: verl
averages each micro-batch's tokens and then the micro-batches; tiller normalises by the step's token
count (the two agree only when every micro-batch holds the same number of response tokens).

Example:
    tiller sft model.partial_pretrain=./tiny data.train_files=[train.jsonl] data.val_files=[val.jsonl] \\
        data.packing=True optim.lr=1e-4 trainer.total_epochs=3 trainer.default_local_dir=runs/sft
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

import torch

from tiller.algos import aggregate_loss, logprobs_and_entropy, sft_token_loss
from tiller.algos.entropy import head_logprobs_and_entropy
from tiller.algos.sft import label_smoothed_loss
from tiller.config import load_config
from tiller.config.args import add_config_args
from tiller.config.jobs import SFTConfig, validate_job
from tiller.data.packing import flatten_micro_batch, forward_output, make_micro_batches
from tiller.models.layer_masks import refuse_packing
from tiller.data.sft import IGNORE, SFTExample, load_sft_examples
from tiller.errors import ConfigError, UserError
from tiller.models.chat_template import set_chat_template
from tiller.models.compile import compile_layers
from tiller.models.loading import is_load_error, is_vision_checkpoint, load_causal_lm, load_tokenizer
from tiller.models.lora import attach_lora, lora_enabled
from tiller.models.quant import bnb_config, quantize_after_load
from tiller.models.quiet import fresh_head
from tiller.models.vision import is_vision_model, load_processor, vision_tower
from tiller.trainer.loop import resolve_device, run_training, seed_everything
from tiller.workers.common import Float32Head
from tiller.workers.packed import fused_head
from tiller.workers.ulysses import ulysses_token_forward


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] [...] in fp32 from logits [..., V] in the model's dtype, without an fp32 copy of
    the logits (`logprobs_and_entropy`'s chunks; the same numbers as `logprobs_from_logits(logits.float(), ...)`)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return logprobs_and_entropy(flat, labels.reshape(-1))[0].view(labels.shape)


class SFTJob:
    """Token-mean NLL (or DFT) on response tokens (see the module docstring)."""

    def __init__(self, pad_id: int, micro_batch_size: int, packing: bool = False, pack_length: int | None = None,
                 loss_kind: str = "nll", router_aux_coef: float = 0.0, label_smoothing: float = 0.0,
                 fuse_head: bool = False):
        self.pad_id, self.micro_batch_size = pad_id, micro_batch_size
        self.packing, self.pack_length, self.loss_kind = packing, pack_length, loss_kind
        self.router_aux_coef, self.label_smoothing = router_aux_coef, label_smoothing
        if fuse_head and (router_aux_coef or label_smoothing):
            raise ConfigError("model.use_liger=True runs the LM head with the log-probs of the labelled tokens only: "
                              "not with model.router_aux_loss_coef or algorithm.label_smoothing (they need the "
                              "model's whole output)")
        self.fuse_head = fuse_head  # model.use_liger: the head run with the log-probs (`_fused_loss`)
        self._head_parts: dict[int, tuple | None] = {}
        self.sp = None  # Ulysses sequence parallelism: this rank's group (set by run_training under torchrun)

    def _token_loss(self, logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.label_smoothing:  # transformers' LabelSmoother (TRL's label_smoothing_factor)
            return label_smoothed_loss(logp, logits, self.label_smoothing)
        return sft_token_loss(logp, self.loss_kind)

    def micro_batches(self, examples: Sequence[SFTExample]) -> list[dict[str, torch.Tensor]]:
        micros = make_micro_batches(examples, self.micro_batch_size, self.pad_id, self.packing, self.pack_length)
        if self.fuse_head:  # the labelled positions, found here on the host (on the device: a sync per micro-batch)
            for micro in micros:
                micro["label_index"] = (micro["labels"].reshape(-1) != IGNORE).nonzero().squeeze(-1)
        return micros

    def normalizer(self, examples: Sequence[SFTExample]) -> float:
        return float(sum(e.num_loss_tokens for e in examples))

    def prepare_step(self, model, micro_batches) -> None:
        return None

    def loss(self, model, micro: dict[str, torch.Tensor], normalizer: float):
        if self.sp is not None:
            if self.fuse_head and not self._head_parts:
                print("model.use_liger=True: not under sequence parallelism; its forwards compute the logits whole",
                      file=sys.stderr)
                self._head_parts[None] = None
            return self._split_loss(model, micro, normalizer)
        parts = self._fused_parts(model) if "label_index" in micro else None
        if parts is not None and micro.get("multi_modal") is None:
            return self._fused_loss(parts, micro, normalizer)
        out = forward_output(model, micro, router_aux=bool(self.router_aux_coef))
        labels = micro["labels"]
        mask = labels != IGNORE
        logp = token_logprobs(out.logits, labels.clamp(min=0))
        loss = aggregate_loss(self._token_loss(logp, out.logits), mask, "token-mean", global_tokens=normalizer)
        metrics = {"num_tokens": mask.sum()}
        if self.router_aux_coef:  # the MoE router's balance, this micro-batch's by its share of the step's tokens
            loss, metrics["aux_loss"] = add_router_aux(loss, out, self.router_aux_coef, mask.sum() / normalizer)
        if self.loss_kind != "nll" or self.label_smoothing:  # the NLL stays reported (perplexity is exp of it)
            metrics["nll"] = aggregate_loss(-logp.detach(), mask, "token-mean", global_tokens=normalizer)
        return loss, metrics

    def _fused_parts(self, model) -> tuple | None:
        """(decoder, LM head) where model.use_liger runs the head with the log-probs (`fused_head`), else None: a
        model it does not fit computes its logits whole, said once."""
        if id(model) not in self._head_parts:
            parts = fused_head(model)
            if isinstance(parts, str):
                print(f"model.use_liger=True: {parts}; its forwards compute the logits whole", file=sys.stderr)
                parts = None
            self._head_parts[id(model)] = parts
        return self._head_parts[id(model)]

    def _fused_loss(self, parts: tuple, micro: dict[str, torch.Tensor], normalizer: float):
        """`loss` with the LM head run with the log-probs on the labelled tokens only
        (`head_logprobs_and_entropy`): the decoder's hidden states at `label_index`, no [tokens, V] logits."""
        decoder, head = parts
        index = micro["label_index"]
        hidden = forward_output(decoder, micro).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        labels = micro["labels"].reshape(-1).index_select(0, index)
        logp, _ = head_logprobs_and_entropy(hidden, head.weight, head.bias, labels,
                                            fp32=isinstance(head, Float32Head))
        logp = logp[None]  # [1, M]: the labelled tokens as one row (a token mean over the step's normalizer)
        ones = torch.ones_like(logp)
        loss = aggregate_loss(sft_token_loss(logp, self.loss_kind), ones, "token-mean", global_tokens=normalizer)
        metrics = {"num_tokens": float(index.numel())}
        if self.loss_kind != "nll":
            metrics["nll"] = aggregate_loss(-logp.detach(), ones, "token-mean", global_tokens=normalizer)
        return loss, metrics

    def _split_loss(self, model, micro: dict[str, torch.Tensor], normalizer: float):
        """`loss` under sequence parallelism: the micro-batch's sequences packed end to end, this rank's share of
        the tokens run and scored; the group's ranks' losses and token counts add up to the whole micro-batch's."""
        ids, positions, labels, lengths = flatten_micro_batch(micro)
        logits, (labels,) = ulysses_token_forward(model, ids, positions, lengths, self.sp, labels, fill=IGNORE)
        mask = (labels != IGNORE)[None]
        logp = token_logprobs(logits, labels.clamp(min=0))[None]
        loss = aggregate_loss(self._token_loss(logp, logits[None]), mask, "token-mean", global_tokens=normalizer)
        metrics = {"num_tokens": mask.sum()}
        if self.loss_kind != "nll" or self.label_smoothing:
            metrics["nll"] = aggregate_loss(-logp.detach(), mask, "token-mean", global_tokens=normalizer)
        return loss, metrics

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        out = dict(sums)
        out["perplexity"] = math.exp(min(sums.get("nll", sums["loss"]), 50.0))
        return out


def add_router_aux(loss: torch.Tensor, output, coef: float, share) -> tuple[torch.Tensor, torch.Tensor]:
    """loss + coef x share x the model output's router load-balancing loss; returns (loss, share x aux detached)."""
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        raise ConfigError("model.router_aux_loss_coef: the model returned no router loss (aux_loss) for "
                          "output_router_logits=True")
    aux = aux.to(loss.dtype) * share
    return loss + coef * aux, aux.detach()


def default_pack_length(examples: Sequence[SFTExample], max_length: int) -> int:
    """Row capacity for packing: a few typical sequences per row, never below the longest one.

    Attention on CPU (sdpa / eager, no variable-length kernel) costs capacity^2 per row even with the
    block-diagonal mask, so rows much longer than needed are slower than padding. Measured (2M model,
    1 thread, fwd+bwd of 128 arithmetic SFT sequences of ~38 tokens, best of 3): padded 2.30 s, rows of
    152 (this default) 2.33 s, rows of 512 3.54 s. Packing pays off when lengths vary: 64 sequences of
    16-256 tokens on a 5M model, padded 15-24 s vs packed rows of 256 7.5-14 s (noisy shared CPU).
    """
    lengths = [len(e.input_ids) for e in examples]
    return min(max_length, max(max(lengths), 4 * math.ceil(sum(lengths) / len(lengths))))


def build_model_and_tokenizer(cfg, head: str = "causal_lm"):
    """Load the model to train (`causal_lm` or a 1-label `seq_cls` head) and its tokenizer, LoRA applied."""
    m = cfg.model
    tokenizer = load_tokenizer(m.tokenizer_path or m.partial_pretrain, trust_remote_code=m.trust_remote_code)
    set_chat_template(tokenizer, m.custom_chat_template)  # verl's model.custom_chat_template (saved with the model)
    compute = torch.bfloat16 if cfg.optim.dtype in ("bfloat16", "bf16") else torch.float32
    quant = bnb_config(m, compute)  # QLoRA (model.load_in_4bit): 4-bit body, adapters on top
    if head == "seq_cls":
        model = load_seq_cls(m.partial_pretrain, tokenizer, m.trust_remote_code, m.attn_implementation, quant)
    else:
        model = load_causal_lm(m.partial_pretrain, trust_remote_code=m.trust_remote_code,
                               attn_implementation=m.attn_implementation, quantization_config=quant)
    if m.enable_gradient_checkpointing:
        # transformers 5 renamed it; the old name warns
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.config.use_cache = False
    if m.router_aux_loss_coef and not hasattr(model.config, "output_router_logits"):
        raise ConfigError(f"model.router_aux_loss_coef={m.router_aux_loss_coef}: {m.partial_pretrain} "
                          f"({type(model).__name__}) is not a mixture-of-experts model (no router to balance)")
    if m.disable_dropout:  # TRL's disable_dropout_in_model
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if lora_enabled(m):  # fresh adapters (model.lora_rank > 0) or a saved one (model.lora_adapter_path)
        if m.enable_gradient_checkpointing:
            model.enable_input_require_grads()
        model = attach_lora(model, m, "model")
    if m.freeze_vision_tower:
        if not is_vision_model(model):
            raise ConfigError(f"model.freeze_vision_tower=True but {m.partial_pretrain} ({type(model).__name__}) has "
                              "no vision tower")
        vision_tower(model).requires_grad_(False)
    if m.use_torch_compile:  # the trained model's decoder layers (a deep copy of it, e.g. a reference, is eager)
        compile_layers(model, "model.use_torch_compile")
    return model, tokenizer


def load_seq_cls(path: str, tokenizer, trust_remote_code: bool = False, attn_implementation: str | None = None,
                 quantization_config=None):
    """`AutoModelForSequenceClassification(num_labels=1)` from a causal-LM dir (the head starts random); with a
    `quantization_config` (tiller.models.quant.bnb_config) the body's linear layers load 4-bit."""
    from transformers import AutoModelForSequenceClassification

    kwargs = dict(num_labels=1, trust_remote_code=trust_remote_code, dtype=torch.float32)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if quantization_config is not None:
        kwargs.update(quantization_config=quantization_config, device_map={"": "cpu"})
    try:
        if path.startswith((".", "/")) and not os.path.exists(path):
            raise UserError(f"model path not found: {path}")
        with fresh_head():  # the fresh `score` head is expected, not worth a warning table
            model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    except Exception as err:
        if not is_load_error(err):
            raise
        raise UserError(f"cannot load {path!r} as a sequence-classification model: {err}") from err
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return quantize_after_load(model) if quantization_config is not None else model


def parse_job_args(prog: str, description: str, argv: list[str], schema):
    """argparse with the shared config options, then `load_config` with `validate_job`."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, presets=False)
    args = parser.parse_args(argv)
    return load_config(args.overrides, config_file=args.config, schema=schema, validate=validate_job)


def setup(cfg) -> None:
    if cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    seed_everything(cfg.trainer.seed)


def train_sft(cfg: SFTConfig) -> dict[str, float]:
    """Run SFT as configured; returns the last logged metrics."""
    setup(cfg)
    device = resolve_device(cfg.trainer.device)
    model, tokenizer = build_model_and_tokenizer(cfg)
    model.to(device)
    data = cfg.data
    seed = cfg.trainer.seed
    processor = None  # a vision-language model: its processor encodes image rows and is saved with the model
    if is_vision_checkpoint(cfg.model.partial_pretrain):
        processor = load_processor(cfg.model.partial_pretrain, tokenizer=tokenizer,
                                   trust_remote_code=cfg.model.trust_remote_code)
        set_chat_template(tokenizer, cfg.model.custom_chat_template, processor)
    train = load_sft_examples(data.train_files, data, tokenizer, data.max_samples, seed=seed, processor=processor)
    val = (load_sft_examples(data.val_files, data, tokenizer, data.val_max_samples, which="val", seed=seed,
                             processor=processor) if data.val_files else [])
    if data.packing and any(e.multi_modal is not None for e in (*train, *val)):
        raise UserError("data.packing=True: the data has image conversations, and packing takes text only (a packed "
                        "row would need M-RoPE positions restarted per sequence, which the model's get_rope_index "
                        "does not do); set data.packing=false")
    if data.packing:
        refuse_packing(model)
    if cfg.ulysses_sequence_parallel_size < 1:
        raise ConfigError(f"ulysses_sequence_parallel_size={cfg.ulysses_sequence_parallel_size} must be >= 1")
    if cfg.ulysses_sequence_parallel_size > 1 and (cfg.model.router_aux_loss_coef
                                                   or any(e.multi_modal is not None for e in (*train, *val))):
        raise ConfigError(f"ulysses_sequence_parallel_size={cfg.ulysses_sequence_parallel_size} splits text "
                          "sequences: image conversations and model.router_aux_loss_coef (a router loss over the "
                          "whole batch) are not split; set it to 1")
    job = SFTJob(tokenizer.pad_token_id, data.micro_batch_size_per_gpu, data.packing,
                 data.pack_length or default_pack_length(train, data.max_length), cfg.algorithm.loss,
                 cfg.model.router_aux_loss_coef, cfg.algorithm.label_smoothing, cfg.model.use_liger)
    return run_training(cfg, job, model, processor or tokenizer, train, val, device=device)


def main(argv: list[str]) -> int:
    cfg = parse_job_args("tiller sft", __doc__, argv, SFTConfig)
    train_sft(cfg)
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
