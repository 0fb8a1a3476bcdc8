"""`tiller rm`: a pairwise (Bradley-Terry) reward model on a causal LM with a scalar head.

Model: `AutoModelForSequenceClassification.from_pretrained(causal_lm_dir, num_labels=1)`: the
pretrained transformer plus a fresh linear `score` head read at the last non-pad token (transformers'
sequence classification), so the exported dir loads with the same call and is what the RL trainer's
reward model loads (`reward_model.enable=True reward_model.model.path=<run dir>/hf_model`).

Loss (InstructGPT, Ouyang et al. 2022; margin from Llama-2, Touvron et al. 2023), per pair,
    l = -log sigma(s_chosen - s_rejected - margin),
averaged over the pairs of the optimizer step (`tiller.algos.pairwise_rm_loss`). Metrics:
`accuracy` (share of pairs with s_chosen > s_rejected; ties count as wrong), mean chosen / rejected
scores and their gap. Pairs are rendered exactly as the RL reward-model scorer renders them (the
conversation through the chat template, `tiller.data.preference.render_conversation`), so the
exported model gives the same scores in `tiller.rewards.reward_model.RewardModelScorer`.
`algorithm.center_rewards_coefficient` c adds c (s_chosen + s_rejected)^2 per pair (TRL's centring term).
At export, the mean and std of the trained model's scores over the validation pairs (the training pairs when there
is no validation set), chosen and rejected together, are written to the model's config.json as `mean` / `std`,
as OpenRLHF's train_rm does; `reward_model.normalize` (OpenRLHF's --normalize_reward) reads them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tiller.algos import pairwise_rm_loss
from tiller.config.jobs import RMConfig
from tiller.data.packing import collate_padded, flatten_micro_batch
from tiller.distributed import context as dist_ctx
from tiller.errors import ConfigError
from tiller.workers.ulysses import gather_tokens, ulysses_token_forward
from tiller.data.preference import PairExample, load_preference_examples
from tiller.trainer.loop import resolve_device, run_training, to_device
from tiller.trainer.sft import build_model_and_tokenizer, parse_job_args, setup


def pair_batch(pairs: Sequence[PairExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows: input_ids / attention_mask / labels [2m, L], margin [m]."""
    batch = collate_padded([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    batch["margin"] = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return batch


def sequence_scores(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scalar score per row [R] from a 1-label sequence-classification model (last non-pad token)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits[:, 0].float()


def split_sequence_scores(model, batch: dict[str, torch.Tensor], sp) -> torch.Tensor:
    """`sequence_scores` under Ulysses sequence parallelism: the rows' real tokens packed end to end and this rank's
    share run (`ulysses_token_forward`); the score head's per-token outputs, caught before transformers pools them,
    are gathered over the group and each row's last token read (transformers' last non-pad token) -> [R]."""
    ids, positions, _, lengths = flatten_micro_batch(batch)
    names = [n for n, _ in dist_ctx.unwrap_model(model).named_modules() if n.split(".")[-1] == "score"]
    if not names:
        raise ConfigError("ulysses_sequence_parallel_size > 1: the reward model has no `score` head to read per "
                          "token (transformers' *ForSequenceClassification); set it to 1")
    head = dist_ctx.unwrap_model(model).get_submodule(min(names, key=len))  # (LoRA: peft's wrapper of the head)
    caught: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, _i, out: caught.append(out))
    try:
        ulysses_token_forward(model, ids, positions, lengths, sp)
    finally:
        handle.remove()
    flat = gather_tokens(caught[0][0, :, :1].float(), sp)[: len(ids), 0]  # [N], the padding dropped
    last = torch.tensor(lengths, device=flat.device).cumsum(0) - 1
    return flat[last]


class RMJob:
    """Pairwise reward-model loss (see the module docstring)."""

    def __init__(self, pad_id: int, micro_batch_size: int, loss_kind: str = "sigmoid", use_margin: bool = False,
                 center_coef: float = 0.0):
        self.pad_id, self.micro_batch_size = pad_id, micro_batch_size
        self.loss_kind, self.use_margin, self.center_coef = loss_kind, use_margin, center_coef
        self.stats_examples: Sequence[PairExample] = ()
        self.sp = None  # sequence parallelism (`ulysses_sequence_parallel_size` under torchrun): set by run_training

    def micro_batches(self, examples: Sequence[PairExample]) -> list[dict[str, torch.Tensor]]:
        m = self.micro_batch_size
        return [pair_batch(examples[i:i + m], self.pad_id) for i in range(0, len(examples), m)]

    def normalizer(self, examples: Sequence[PairExample]) -> float:
        return float(len(examples))

    def prepare_step(self, model, micro_batches) -> None:
        return None

    def loss(self, model, micro: dict[str, torch.Tensor], normalizer: float):
        scores = sequence_scores(model, micro) if self.sp is None else split_sequence_scores(model, micro, self.sp)
        chosen, rejected = scores.chunk(2)
        margin = micro["margin"] if self.use_margin else None
        loss = pairwise_rm_loss(chosen, rejected, margin, kind=self.loss_kind,
                                center_coef=self.center_coef).sum() / normalizer
        detached = (chosen.detach(), rejected.detach())
        metrics = {
            "accuracy": (detached[0] > detached[1]).float().sum() / normalizer,
            "score_chosen": detached[0].sum() / normalizer,
            "score_rejected": detached[1].sum() / normalizer,
            "score_gap": (detached[0] - detached[1]).sum() / normalizer,
        }
        if self.sp is not None:  # every rank of the group holds the whole micro-batch's loss and metrics: each
            # logs a 1/S share (the loop sums them over the ranks; the loss it back-propagates stays whole)
            metrics = {k: v / self.sp.size for k, v in {"loss": loss.detach(), **metrics}.items()}
        return loss, metrics

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return dict(sums)

    def set_stats_examples(self, examples: Sequence[PairExample]) -> None:
        """The pairs whose scores give the mean / std written at export."""
        self.stats_examples = examples

    @torch.no_grad()
    def before_export(self, model, device) -> None:
        """Store the mean / std (unbiased) of the scores of `stats_examples` in `model.config` (OpenRLHF's keys)."""
        examples = self.stats_examples
        if not examples:
            return
        was_training = model.training
        model.eval()
        scores = [sequence_scores(model, to_device(micro, device)).cpu() for micro in self.micro_batches(examples)]
        model.train(was_training)
        all_scores = torch.cat(scores)
        model.config.mean = float(all_scores.mean())
        model.config.std = float(all_scores.std()) if len(all_scores) > 1 else 1.0


def train_rm(cfg: RMConfig) -> dict[str, float]:
    """Train a reward model as configured; returns the last logged metrics."""
    setup(cfg)
    device = resolve_device(cfg.trainer.device)
    model, tokenizer = build_model_and_tokenizer(cfg, head="seq_cls")
    model.to(device)
    data = cfg.data
    train = load_preference_examples(data.train_files, data, tokenizer, "rm", data.max_samples, seed=cfg.trainer.seed)
    val = (load_preference_examples(data.val_files, data, tokenizer, "rm", data.val_max_samples, which="val",
                                    seed=cfg.trainer.seed)
           if data.val_files else [])
    job = RMJob(tokenizer.pad_token_id, data.micro_batch_size_per_gpu, cfg.algorithm.loss, bool(data.margin_key),
                cfg.algorithm.center_rewards_coefficient)
    job.set_stats_examples(val or train)
    return run_training(cfg, job, model, tokenizer, train, val, device=device)


def main(argv: list[str]) -> int:
    cfg = parse_job_args("tiller rm", __doc__, argv, RMConfig)
    train_rm(cfg)
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
