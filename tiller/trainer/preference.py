"""`tiller dpo` (DPO / IPO / cDPO) and `tiller kto`: offline preference training of a causal LM.

Sequence log-probabilities: log pi(y | x) = sum over completion tokens of log pi(y_t | x, y_<t)
(prompt tokens excluded), for the policy and for a frozen reference.

DPO (Rafailov et al. 2023, arXiv 2305.18290), h = (log pi(y_c) - log pi(y_r)) - (log ref(y_c) - log ref(y_r)):
  dpo:  -log sigma(beta h);  cdpo (Mitchell 2023): -(1-eps) log sigma(beta h) - eps log sigma(-beta h);
  ipo (Azar et al. 2023, arXiv 2310.12036): (h - 1/(2 beta))^2 on LENGTH-AVERAGED log-probs (as TRL);
  hinge (SLiC): max(0, 1 - beta h); robust (Chowdhury 2024): cDPO's terms made unbiased, divided by 1 - 2 eps;
  TRL 1.16's others by its names (exo_pair, nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down,
  discopop, sigmoid_norm, and sft: the chosen completions' token-mean NLL over the micro-batch, as TRL), a list of
  them weighted (algorithm.loss_weights; e.g. MPO), f-DPO's divergences (algorithm.f_divergence), LD-DPO
  (algorithm.ld_alpha) and WPO weighting (algorithm.use_weighting). aot / aot_unpaired sort the micro-batch's pairs
  and sft averages over its tokens: as TRL per device batch, those depend on data.micro_batch_size_per_gpu.
The math is `tiller.algos.dpo_loss`; the step loss is the mean over the step's pairs (a weighted sum of the losses).
Without a reference (`tiller.algos.reference_free_loss`; no reference model is loaded when every loss is one of
these or sft): simpo (SimPO), cpo / cpo_hinge / cpo_ipo (CPO, + algorithm.cpo_alpha x the chosen NLL),
orpo (ORPO, + the chosen NLL), AlphaPO's rewards with simpo / cpo_ipo (algorithm.alphapo_alpha); the NLL
is sft's token mean over the micro-batch, as TRL's CPOTrainer / ORPOTrainer compute it; they log nll_loss, and orpo
log_odds_ratio / log_odds_chosen (TRL's names); rewards are beta x the log-probs each loss reads.

KTO (Ethayarajh et al. 2024, arXiv 2402.01306), r = log pi(y|x) - log ref(y|x):
  desirable: w_D (1 - sigma(beta (r - z0))), undesirable: w_U (1 - sigma(beta (z0 - r))),
  z0 = max(0, mean over the step of log pi(y'|x) - log ref(y'|x)), detached, where (x, y') are
  MISMATCHED pairs: the prompt of example i with the completion of example i-1 (TRL's KL dataset).
The math is `tiller.algos.kto_loss`; the step loss is the mean over the step's examples.
`algorithm.loss=apo_zero_unpaired` (APO-zero, unpaired): desirable 1 - sigma(beta r), undesirable sigma(beta r) =
1 - sigma(-beta r): the KTO losses with z0 = 0 (no mismatched pairs are run), as TRL's KTOTrainer computes it.
Deviation: TRL estimates z0 per device micro-batch; tiller estimates it once over the whole
optimizer step (a no-grad pre-pass), so the update does not depend on the micro-batch size.

Reference: `model.ref_path` (default `model.partial_pretrain`) loaded frozen; with LoRA and no `ref_path`, the
policy with its adapters disabled IS the base model, so no second copy is loaded (as TRL / peft do);
continuing from a saved adapter (`model.lora_adapter_path`), the reference is the starting policy, base + that
adapter (merged, frozen), as DPO's pi_ref is the policy it starts from. DPO can instead read precomputed
reference log-prob sums from the data (`data.ref_chosen_logps_key` / `data.ref_rejected_logps_key`); then no
reference model runs.
Logged as TRL names them: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
logps/chosen, logps/rejected (DPO); kl, rewards/chosen, rewards/rejected (KTO).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from tiller.algos import dpo_loss, kto_loss, logprobs_from_logits, reference_free_loss
from tiller.algos.preference import REFERENCE_FREE_LOSSES
from tiller.config.jobs import dpo_loss_names, DPOConfig, KTOConfig, uses_reference
from tiller.data.packing import collate_padded, flatten_micro_batch, forward_logits, forward_output
from tiller.data.preference import PairExample, UnpairedExample, load_preference_examples, make_sequence
from tiller.data.sft import IGNORE
from tiller.distributed.context import all_reduce_sum
from tiller.errors import ConfigError
from tiller.models.loading import load_causal_lm
from tiller.models.lora import is_lora, load_lora_adapter, merge_lora
from tiller.models.neftune import without_neftune
from tiller.models.ref_sync import RefSync
from tiller.trainer.loop import resolve_device, run_training
from tiller.trainer.sft import add_router_aux, build_model_and_tokenizer, parse_job_args, setup
from tiller.workers.ulysses import gather_tokens, ulysses_token_forward


def token_logps(model, batch: dict[str, torch.Tensor], log_sum_sq: bool = False):
    """(completion-token log-probs [R, T] (0 elsewhere), completion mask [R, T], and with `log_sum_sq` the per-position
    log sum_v p_v^2 [R, T] (WPO's alignment term; else None)) of a padded batch."""
    return logps_of(forward_logits(model, batch), batch, log_sum_sq)


def logps_of(logits: torch.Tensor, batch: dict[str, torch.Tensor], log_sum_sq: bool = False):
    """`token_logps` of logits already computed for `batch`."""
    logits = logits.float()
    labels = batch["labels"]
    mask = labels != IGNORE
    logp = logprobs_from_logits(logits, labels.clamp(min=0))
    sq = torch.logsumexp(2 * torch.log_softmax(logits, dim=-1), dim=-1) if log_sum_sq else None
    return torch.where(mask, logp, torch.zeros_like(logp)), mask, sq


def split_token_logps(model, batch: dict[str, torch.Tensor], sp, log_sum_sq: bool = False):
    """`token_logps` under sequence parallelism: the padded rows' tokens packed end to end, this rank's share run
    (`ulysses_token_forward`), the per-token results gathered back to [R, T] on every rank of the group."""
    ids, positions, labels, lengths = flatten_micro_batch(batch)
    logits, (local_labels,) = ulysses_token_forward(model, ids, positions, lengths, sp, labels, fill=IGNORE)
    logits = logits.float()
    cols = [logprobs_from_logits(logits, local_labels.clamp(min=0))]
    if log_sum_sq:
        cols.append(torch.logsumexp(2 * torch.log_softmax(logits, dim=-1), dim=-1))
    flat = gather_tokens(torch.stack(cols, dim=-1), sp)[: len(ids)]  # [N, c], the padding dropped
    keep = batch["attention_mask"].bool()
    full = flat.new_zeros((*keep.shape, flat.shape[-1]))
    full[keep] = flat
    mask = batch["labels"] != IGNORE
    logp = torch.where(mask, full[..., 0], torch.zeros_like(full[..., 0]))
    return logp, mask, (full[..., 1] if log_sum_sq else None)


def sequence_logps(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of completion-token log-probs [R], completion-token count [R]) of a padded batch."""
    logp, mask, _ = token_logps(model, batch)
    return logp.sum(-1), mask.sum(-1)


class Reference:
    """Frozen reference log-probs: a separate model, or the LoRA policy with adapters disabled. With TR-DPO's
    updates (`sync`, a `RefSync`) the separate model moves toward the policy every N optimizer steps."""

    def __init__(self, model: torch.nn.Module | None = None, policy: torch.nn.Module | None = None,
                 sync: RefSync | None = None):
        self.model, self.policy, self.sync = model, policy, sync
        self.sp = None  # sequence parallelism: the reference's forward is split as the policy's

    def after_optimizer_step(self, policy: torch.nn.Module, step: int) -> None:
        """TR-DPO: after optimizer step `step` (1-based), mix the policy in when it is the N-th."""
        if self.sync is not None:
            self.sync.optimizer_steps = step - 1
            self.sync.after_optimizer_step(self.model, policy)

    @torch.no_grad()
    def token_logps(self, batch: dict[str, torch.Tensor]):
        def run(model):
            return token_logps(model, batch) if self.sp is None else split_token_logps(model, batch, self.sp)

        if self.model is not None:
            return run(self.model)
        with self.policy.disable_adapter(), without_neftune(self.policy):  # the reference sees clean embeddings
            return run(self.policy)

    def logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logp, mask, _ = self.token_logps(batch)
        return logp.sum(-1), mask.sum(-1)


def build_reference(cfg, policy: torch.nn.Module, device: torch.device) -> Reference:
    """model.ref_path; else the starting policy: the base (a LoRA policy with its adapters disabled), or, continuing
    from a saved adapter (model.lora_adapter_path), the base with that adapter merged in."""
    m = cfg.model
    if is_lora(policy) and m.ref_path is None and not m.lora_adapter_path:
        return Reference(policy=policy)
    ref = load_causal_lm(m.ref_path or m.partial_pretrain, trust_remote_code=m.trust_remote_code,
                         attn_implementation=m.attn_implementation)
    if m.ref_path is None and m.lora_adapter_path:
        ref = merge_lora(load_lora_adapter(ref, m.lora_adapter_path, "model.lora_adapter_path"))
    ref = ref.to(device).eval()
    ref.requires_grad_(False)
    algo = cfg.algorithm
    sync = (RefSync(algo.ref_model_sync_steps, algo.ref_model_mixup_alpha, "algorithm.ref_model_sync_steps")
            if getattr(algo, "ref_model_sync_steps", None) else None)
    return Reference(model=ref, sync=sync)


class _ReferenceJob:
    """What the loop asks of a job whose reference may follow the policy (TR-DPO): the hook after each optimizer
    step, and the reference model to keep in checkpoints while it moves."""

    reference: Reference | None
    _sp = None  # sequence parallelism (`ulysses_sequence_parallel_size` under torchrun): set by run_training

    @property
    def sp(self):
        return self._sp

    @sp.setter
    def sp(self, group) -> None:  # the reference's forward splits as the policy's
        self._sp = group
        if self.reference is not None:
            self.reference.sp = group

    def _split_metrics(self, loss: torch.Tensor, metrics: dict) -> dict:
        """Under sequence parallelism every rank of the group holds the whole micro-batch's loss and metrics: each
        logs a 1/S share (the loop sums them over the ranks; the loss it back-propagates stays whole)."""
        if self._sp is None:
            return metrics
        return {k: v / self._sp.size for k, v in {"loss": loss.detach(), **metrics}.items()}

    def after_optimizer_step(self, model: torch.nn.Module, step: int) -> None:
        if self.reference is not None:
            self.reference.after_optimizer_step(model, step)

    def checkpoint_models(self) -> dict[str, torch.nn.Module]:
        moving = self.reference is not None and self.reference.sync is not None
        return {"ref": self.reference.model} if moving else {}


class DPOJob(_ReferenceJob):
    """DPO and TRL's other pair losses (see the module docstring)."""

    def __init__(self, reference: Reference | None, pad_id: int, micro_batch_size: int, loss="dpo",
                 beta: float = 0.1, label_smoothing: float = 0.0, loss_weights=None, f_divergence: str = "reverse_kl",
                 f_alpha: float = 0.5, discopop_tau: float = 0.05, ld_alpha: float | None = None,
                 use_weighting: bool = False, router_aux_coef: float = 0.0, simpo_gamma: float = 0.5,
                 cpo_alpha: float = 1.0, alphapo_alpha: float = 0.0):
        self.reference, self.pad_id, self.micro_batch_size = reference, pad_id, micro_batch_size
        self.router_aux_coef = router_aux_coef
        self.losses = dpo_loss_names(loss)  # (dpo / cdpo: sigmoid with label smoothing; TRL's sigmoid: without)
        self.weights = [float(w) for w in loss_weights] if loss_weights is not None else [1.0] * len(self.losses)
        self.beta, self.label_smoothing = beta, label_smoothing
        self.f_divergence, self.f_alpha, self.discopop_tau = f_divergence, f_alpha, discopop_tau
        self.ld_alpha, self.use_weighting = ld_alpha, use_weighting
        self.simpo_gamma, self.cpo_alpha, self.alphapo_alpha = simpo_gamma, cpo_alpha, alphapo_alpha
        self.uses_reference = uses_reference(self.losses)

    def micro_batches(self, examples: Sequence[PairExample]) -> list[dict[str, torch.Tensor]]:
        out = []
        for i in range(0, len(examples), self.micro_batch_size):
            pairs = examples[i:i + self.micro_batch_size]
            batch = collate_padded([p.chosen for p in pairs] + [p.rejected for p in pairs], self.pad_id)
            if pairs[0].ref_chosen_logp is not None:
                batch["ref_logps"] = torch.tensor([p.ref_chosen_logp for p in pairs]
                                                  + [p.ref_rejected_logp for p in pairs], dtype=torch.float32)
            out.append(batch)
        return out

    def normalizer(self, examples) -> float:
        return float(len(examples))

    def prepare_step(self, model, micro_batches) -> None:
        return None

    def _sums(self, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-row log-prob sums; with LD-DPO, tokens past the shorter completion of the pair weighted by ld_alpha."""
        if self.ld_alpha is None:
            return logp.sum(-1)
        pos = mask.long().cumsum(-1)
        shared = torch.minimum(*mask.sum(-1).chunk(2)).repeat(2).unsqueeze(1)
        return (logp * (pos <= shared)).sum(-1) + self.ld_alpha * (logp * (pos > shared)).sum(-1)

    def loss(self, model, micro: dict[str, torch.Tensor], normalizer: float):
        if self._sp is not None:  # this rank's share of the tokens, the per-token log-probs gathered
            out = None
            tok, mask, log_sq = split_token_logps(model, micro, self._sp, log_sum_sq=self.use_weighting)
        else:
            out = forward_output(model, micro, router_aux=bool(self.router_aux_coef))
            tok, mask, log_sq = logps_of(out.logits, micro, log_sum_sq=self.use_weighting)
        logps, counts = self._sums(tok, mask), mask.sum(-1)
        if "ref_logps" in micro:
            ref_logps = micro["ref_logps"]
        elif not self.uses_reference:  # simpo / cpo / orpo / sft: no reference runs (its log-probs stand at 0)
            ref_logps = torch.zeros_like(logps)
        elif self.reference is None:
            raise ValueError("DPO needs a reference model or precomputed reference log-probs")
        else:
            ref_tok, _, _ = self.reference.token_logps(micro)
            ref_logps = self._sums(ref_tok, mask)
        pc, pr = logps.chunk(2)
        rc, rr = ref_logps.chunk(2)
        lc, lr = counts.chunk(2)
        chosen_tok, chosen_mask = tok.chunk(2)[0], mask.chunk(2)[0]
        nll = -chosen_tok[chosen_mask].mean()  # the chosen completions' token-mean NLL over the micro-batch (TRL's)
        extra: dict[str, torch.Tensor] = {}
        weight = None
        if self.use_weighting:  # WPO: exp(mean over the completion of log p - log sum_v p_v^2), detached, c x r
            with torch.no_grad():
                aligned = (((tok - log_sq) * mask).sum(-1) / counts.clamp(min=1)).exp()
                weight = aligned.chunk(2)[0] * aligned.chunk(2)[1]
        total = 0.0
        chosen_r, rejected_r = (self.beta * (pc - rc)).detach(), (self.beta * (pr - rr)).detach()
        for name, w in zip(self.losses, self.weights):
            if name == "sft":  # the chosen completions' token-mean NLL over the micro-batch, as TRL
                per = nll * torch.ones_like(pc)
            elif name in REFERENCE_FREE_LOSSES:
                per, chosen_r, rejected_r, log_odds = reference_free_loss(
                    pc, pr, lc, lr, self.beta, name, self.label_smoothing, self.simpo_gamma, self.alphapo_alpha)
                if name != "simpo":  # CPO's and ORPO's NLL term on the chosen completions (per pair: its share)
                    per = per + (1.0 if name == "orpo" else self.cpo_alpha) * nll
                    extra["nll_loss"] = nll.detach() * pc.shape[0]
                if log_odds is not None:
                    extra["log_odds_ratio"] = log_odds.detach().sum()
                    extra["log_odds_chosen"] = F.logsigmoid(log_odds).detach().sum()
            else:
                eps = 0.0 if name == "sigmoid" else self.label_smoothing
                per, _, _ = dpo_loss(pc, pr, rc, rr, self.beta, "sigmoid" if name in ("dpo", "cdpo") else name, eps,
                                     f_divergence=self.f_divergence, f_alpha=self.f_alpha, chosen_lengths=lc,
                                     rejected_lengths=lr, discopop_tau=self.discopop_tau)
            total = total + w * (per * weight if weight is not None else per).sum()
        n = normalizer
        metrics = {
            "rewards/chosen": chosen_r.sum() / n,
            "rewards/rejected": rejected_r.sum() / n,
            "rewards/accuracies": (chosen_r > rejected_r).float().sum() / n,
            "rewards/margins": (chosen_r - rejected_r).sum() / n,
            "logps/chosen": pc.detach().sum() / n,
            "logps/rejected": pr.detach().sum() / n,
            **{k: v / n for k, v in extra.items()},
        }
        loss = total / n
        if self.router_aux_coef:  # the MoE router's balance over the pairs' forward, by its share of the step
            loss, metrics["aux_loss"] = add_router_aux(loss, out, self.router_aux_coef, pc.shape[0] / n)
        return loss, self._split_metrics(loss, metrics)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return dict(sums)


class KTOJob(_ReferenceJob):
    """KTO with the KL baseline from mismatched pairs of the whole step (see the module docstring)."""

    def __init__(self, reference: Reference, pad_id: int, micro_batch_size: int, max_length: int,
                 beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
                 truncation: str = "left", use_kl: bool = True, router_aux_coef: float = 0.0):
        self.reference, self.pad_id, self.micro_batch_size = reference, pad_id, micro_batch_size
        self.router_aux_coef = router_aux_coef
        self.use_kl = use_kl  # False: apo_zero_unpaired, the baseline stays 0
        self.max_length = max_length
        # data.truncation=error was checked on the data (a KL pair may still be longer: cut it at the prompt start)
        self.truncation = "left" if truncation == "error" else truncation
        self.beta, self.w_d, self.w_u = beta, desirable_weight, undesirable_weight
        self.kl_baseline = torch.zeros(())

    def micro_batches(self, examples: Sequence[UnpairedExample]) -> list[dict[str, torch.Tensor]]:
        n = len(examples)
        seqs = [make_sequence(e.prompt_ids, e.completion_ids, self.max_length, self.truncation, "kto")
                for e in examples]
        # prompt i with the completion of example i-1 (a rotation: no example meets its own completion)
        kl_seqs = ([make_sequence(examples[i].prompt_ids, examples[(i - 1) % n].completion_ids, self.max_length,
                                  self.truncation, "kto KL pair") for i in range(n)] if self.use_kl else [])
        out = []
        for i in range(0, n, self.micro_batch_size):
            batch = collate_padded(seqs[i:i + self.micro_batch_size], self.pad_id)
            batch["desirable"] = torch.tensor([e.desirable for e in examples[i:i + self.micro_batch_size]])
            if self.use_kl:
                batch["kl"] = collate_padded(kl_seqs[i:i + self.micro_batch_size], self.pad_id)
            out.append(batch)
        return out

    def normalizer(self, examples) -> float:
        return float(len(examples))

    @torch.no_grad()
    def prepare_step(self, model, micro_batches) -> None:
        """z0 = mean over the step's mismatched pairs of log pi - log ref (clamped at 0 in kto_loss); 0 for APO-zero."""
        if not self.use_kl:
            self.kl_baseline = torch.zeros(())
            return
        total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for micro in micro_batches:
            if self._sp is None:
                policy, _ = sequence_logps(model, micro["kl"])
            else:  # (each rank of the group counts the pair: the sum and the count both S times, the mean the same)
                policy = split_token_logps(model, micro["kl"], self._sp)[0].sum(-1)
            ref, _ = self.reference.logps(micro["kl"])
            if micro.get("pad"):  # a data-parallel padding copy: run (collectives stay paired), not counted
                continue
            total = total + (policy - ref).sum().cpu().double()
            count = count + policy.shape[0]
        # over all ranks (identity in one process): the whole step's baseline, as one process computes it
        summed = all_reduce_sum(torch.stack([total, count]))
        self.kl_baseline = (summed[0] / summed[1].clamp(min=1)).float()

    def loss(self, model, micro: dict[str, torch.Tensor], normalizer: float):
        if self._sp is not None:  # this rank's share of the tokens, the per-token log-probs gathered
            out, (tok, _, _) = None, split_token_logps(model, micro, self._sp)
        else:
            out = forward_output(model, micro, router_aux=bool(self.router_aux_coef))
            tok, _, _ = logps_of(out.logits, micro)
        logps = tok.sum(-1)
        ref_logps, _ = self.reference.logps(micro)
        kl = self.kl_baseline.to(logps.device)
        losses, m = kto_loss(logps, ref_logps, micro["desirable"].to(logps.device), kl, self.beta, self.w_d, self.w_u)
        share = logps.shape[0] / normalizer
        metrics = {
            "kl": m["kl"] * share,
            "rewards_chosen_sum": m["rewards_chosen_sum"], "rewards_rejected_sum": m["rewards_rejected_sum"],
            "num_chosen": m["num_chosen"].float(), "num_rejected": m["num_rejected"].float(),
        }
        loss = losses.sum() / normalizer
        if self.router_aux_coef:
            loss, metrics["aux_loss"] = add_router_aux(loss, out, self.router_aux_coef, share)
        return loss, self._split_metrics(loss, metrics)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        out = {"loss": sums["loss"], "kl": sums["kl"]}
        if "aux_loss" in sums:
            out["aux_loss"] = sums["aux_loss"]
        if sums["num_chosen"]:
            out["rewards/chosen"] = sums["rewards_chosen_sum"] / sums["num_chosen"]
        if sums["num_rejected"]:
            out["rewards/rejected"] = sums["rewards_rejected_sum"] / sums["num_rejected"]
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def _load(cfg, kind: str):
    setup(cfg)
    device = resolve_device(cfg.trainer.device)
    model, tokenizer = build_model_and_tokenizer(cfg)
    model.to(device)
    data = cfg.data
    seed = cfg.trainer.seed
    train = load_preference_examples(data.train_files, data, tokenizer, kind, data.max_samples, seed=seed)
    val = (load_preference_examples(data.val_files, data, tokenizer, kind, data.val_max_samples, which="val", seed=seed)
           if data.val_files else [])
    return model, tokenizer, train, val, device


def train_dpo(cfg: DPOConfig) -> dict[str, float]:
    """Run DPO / IPO / cDPO as configured; returns the last logged metrics."""
    model, tokenizer, train, val, device = _load(cfg, "paired")
    algo = cfg.algorithm
    if cfg.ulysses_sequence_parallel_size > 1 and (cfg.model.router_aux_loss_coef or any(
            p.chosen.multi_modal is not None for p in (*train, *val))):
        raise ConfigError(f"ulysses_sequence_parallel_size={cfg.ulysses_sequence_parallel_size} splits text "
                          "sequences: image pairs and model.router_aux_loss_coef (a router loss over the whole batch) "
                          "are not split; set it to 1")
    # precomputed reference log-probs, or a loss that reads no reference (simpo / cpo / orpo / sft): no model loaded
    skip = cfg.data.ref_chosen_logps_key is not None or not uses_reference(dpo_loss_names(algo.loss))
    reference = None if skip else build_reference(cfg, model, device)
    job = DPOJob(reference, tokenizer.pad_token_id, cfg.data.micro_batch_size_per_gpu, algo.loss, algo.beta,
                 algo.label_smoothing, algo.loss_weights, algo.f_divergence, algo.f_alpha_divergence_coef,
                 algo.discopop_tau, algo.ld_alpha, algo.use_weighting, cfg.model.router_aux_loss_coef,
                 algo.simpo_gamma, algo.cpo_alpha, algo.alphapo_alpha)
    return run_training(cfg, job, model, tokenizer, train, val, device=device)


def train_kto(cfg: KTOConfig) -> dict[str, float]:
    """Run KTO as configured; returns the last logged metrics."""
    model, tokenizer, train, val, device = _load(cfg, "unpaired")
    algo = cfg.algorithm
    if cfg.ulysses_sequence_parallel_size > 1 and cfg.model.router_aux_loss_coef:
        raise ConfigError(f"ulysses_sequence_parallel_size={cfg.ulysses_sequence_parallel_size} splits the "
                          "sequences: model.router_aux_loss_coef (a router loss over the whole batch) is not split; "
                          "set one of them to 0 / 1")
    job = KTOJob(build_reference(cfg, model, device), tokenizer.pad_token_id, cfg.data.micro_batch_size_per_gpu,
                 cfg.data.max_length, algo.beta, algo.desirable_weight, algo.undesirable_weight, cfg.data.truncation,
                 use_kl=algo.loss == "kto", router_aux_coef=cfg.model.router_aux_loss_coef)
    return run_training(cfg, job, model, tokenizer, train, val, device=device)


def main_dpo(argv: list[str]) -> int:
    train_dpo(parse_job_args("tiller dpo", __doc__, argv, DPOConfig))
    return 0


def main_kto(argv: list[str]) -> int:
    train_kto(parse_job_args("tiller kto", __doc__, argv, KTOConfig))
    return 0

