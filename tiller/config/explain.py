"""`tiller config explain`: the batch arithmetic of a resolved RL config and a peak-memory estimate per rank.

verl's and OpenRLHF's most asked questions are what train_batch_size, ppo_mini_batch_size,
ppo_micro_batch_size_per_gpu, rollout.n and use_dynamic_bsz mean together, and whether a run fits in memory.
This module answers both before anything runs: `batch_arithmetic(cfg)` (pure arithmetic on the config, plus the
row count of the training files when they can be read from parquet / jsonl metadata) and
`memory_estimate(cfg)` (the model's shape from its config.json: the parameters are built on the meta
device, nothing is loaded).

Batch arithmetic (verl's semantics; W = data-parallel workers: the workers / actor.ulysses_sequence_parallel_size,
whose groups split each micro-batch's tokens, and whose token budgets are per worker, x that size):
    samples per step        = train_batch_size x rollout.n
    mini-batches per step   = train_batch_size / ppo_mini_batch_size    (prompts; x n samples each)
    optimizer steps / step  = ppo_epochs x mini-batches per step
    samples per rank        = ppo_mini_batch_size x n / W               (per mini-batch)
    grad accumulation       = samples per rank / ppo_micro_batch_size_per_gpu   (micro-batches per rank)
    tokens per micro-batch  = ppo_micro_batch_size_per_gpu x (max prompt + max response length)
    use_dynamic_bsz         : micro-batches hold <= ppo_max_token_len_per_gpu padded tokens instead
    steps per epoch         = training prompts // train_batch_size; total = total_training_steps or that x epochs

Memory per rank (bytes; N = parameters, N_t = trainable parameters, W ranks sharing FSDP state):
    weights      4 N / W                     (fp32 master weights; the compute dtype is an autocast copy)
    reference    4 N / W when a KL term needs the reference model and the actor is not LoRA
    gradients    4 N_t / W                   (during the update only)
    optimizer    s N_t / W                   (s = state bytes per parameter of actor.optim's class, measured by one
                                             step on a dummy parameter: AdamW 8 (two moments), SGD 0, with momentum 4)
    activations  per micro-batch of r rows x S tokens: r S L (8 H + 2 kv d + 4 I) b  (saved for backward;
                 b = 2 with bf16 autocast else 4) + logits r T_resp V 4 x 3 (logits, their temperature-scaled
                 float copy, their gradient); algorithm.distill.loss_mode=gjsd adds the teacher's r T_resp V 4 x 2
                 (its logits and their temperature-scaled copy, held during the micro-batch's loss); / sp with
                 Ulysses sequence parallelism (a worker holds its share of the tokens)
    KV cache     rollout rows per rank x S x L x 2 x kv x d x b_rollout (4 on CPU: the engine falls back to
                 fp32 without native bf16)
    teacher      4 N_teacher with algorithm.distill.teacher_path (a frozen full copy in every worker; the sum of
                 them with algorithm.distill.teachers)
    prm          PRIME: 12 N / W (the implicit PRM's weights and AdamW moments) + 4 N (its frozen reference);
                 its gradients live only during its update, before the actor's, so they are not added
    critic       PPO with GAE: the value model (critic.model.path, default the actor's; its body without the LM head
                 plus a value head h + 1): 4 N_c / W weights + s_c N_c,t / W optimizer state (critic.optim's class;
                 N_c,t: the LoRA adapters + head with critic.model.lora_rank); its update (after the actor's) holds
                 4 N_c,t / W gradients + activations of critic.ppo_micro_batch_size_per_gpu rows (no vocab logits)
    runtime      a fixed 150 MiB for what every run holds besides the model (torch's kernels and allocator
                 slack, the tokenizer, the prompt data, the reward manager)
    peak         = weights + reference + teacher + prm + critic + optimizer + runtime + max(gradients + activations,
                   critic update, KV cache + the rollout's logits of one decode step)
It is an estimate: allocator fragmentation and framework caches vary; the test holds it within 35% of the
measured peak RSS of short CPU runs (less the shared libraries' file-backed pages, whose residency depends on the
page cache, not on the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tiller.algos.staleness import batches_per_sync, max_age
from tiller.config.edge import num_workers
from tiller.config.schema import RLConfig
from tiller.config.validate import async_enabled
from tiller.errors import UserError
from tiller.models.loading import check_model_path
from tiller.models.optimizer import state_bytes_per_param

MiB = 1024**2
RUNTIME_BYTES = 150 * MiB


@dataclass
class Arithmetic:
    workers: int
    prompts_per_step: int
    samples_per_step: int
    mini_batches_per_step: float
    optimizer_steps_per_step: float
    samples_per_mini_batch: int
    samples_per_rank: float
    micro_batch_rows: int
    grad_accumulation: int
    seq_len: int
    tokens_per_micro_batch: int
    dynamic_bsz: bool
    token_budget: int
    rows_per_dynamic_micro_batch: int
    prompts: int | None
    steps_per_epoch: int | None
    total_steps: int | None
    problems: list[str] = field(default_factory=list)
    seq_parallel: int = 1  # actor.ulysses_sequence_parallel_size splitting sequences (several Ray workers)

    @property
    def data_parallel(self) -> int:
        """Workers holding different rows: the workers / the sequence-parallel size."""
        return self.workers // self.seq_parallel


def _count_prompts(cfg: RLConfig) -> int | None:
    """Rows of the training files (parquet metadata / jsonl lines), capped by data.max_samples; None if unreadable."""
    if not cfg.data.train_files:
        return None
    total = 0
    for f in cfg.data.train_files:
        path = Path(f).expanduser()
        if not path.is_file():
            return None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                total += pq.ParquetFile(path).metadata.num_rows
            except Exception:  # noqa: BLE001 - not parquet, empty, cut short: the data reader names the problem
                return None
        elif path.suffix in (".jsonl", ".json"):
            with path.open("rb") as fh:  # a count only: the reader reports bad encodings with the line
                total += sum(1 for line in fh if line.strip())
        else:
            return None
    if cfg.data.max_samples > 0:
        total = min(total, cfg.data.max_samples)
    return total


def batch_arithmetic(cfg: RLConfig, count_prompts: bool = True) -> Arithmetic:
    """The batch sizes of one RL step (see the module doc) and any divisibility problem in plain words."""
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, n, w = arr.actor, arr.rollout.n, num_workers(cfg)
    problems = []
    tbs, mbs, micro = data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu
    seq = (arr.rollout.prompt_length or data.max_prompt_length) + (arr.rollout.response_length
                                                                  or data.max_response_length)
    if tbs % mbs:
        problems.append(f"data.train_batch_size={tbs} is not a multiple of actor.ppo_mini_batch_size={mbs}: the last "
                        f"mini-batch of each step would be short. Fix: ppo_mini_batch_size={_divisor_below(tbs, mbs)} "
                        f"or train_batch_size={math.ceil(tbs / mbs) * mbs}")
    sp = actor.ulysses_sequence_parallel_size or 1
    sp = sp if w > 1 and w % sp == 0 else 1  # (one process runs whole sequences)
    dp = w // sp
    samples_mini = mbs * n
    if samples_mini % dp:
        problems.append(f"a mini-batch holds ppo_mini_batch_size x rollout.n = {samples_mini} samples, not a multiple "
                        f"of the {dp} data-parallel workers. Fix: make ppo_mini_batch_size x n a multiple of {dp}")
    per_rank = samples_mini / dp
    if not actor.use_dynamic_bsz and per_rank % micro:
        problems.append(f"each rank's {per_rank:g} samples per mini-batch are not a multiple of "
                        f"ppo_micro_batch_size_per_gpu={micro}: the last micro-batch is short (the update is the "
                        f"same, the memory peak is set by the full ones). Fix: ppo_micro_batch_size_per_gpu="
                        f"{_divisor_below(int(per_rank), micro)}")
    if (tbs * n) % w:
        problems.append(f"train_batch_size x n = {tbs * n} samples do not split over {w} workers: tiller pads with "
                        f"masked rows. Fix: make train_batch_size x n a multiple of {w}")
    budget = actor.ppo_max_token_len_per_gpu * sp  # verl's per-GPU share of a sequence-parallel micro-batch
    dyn_rows = budget // seq if seq else 0
    if actor.use_dynamic_bsz and budget < seq:
        problems.append(f"actor.ppo_max_token_len_per_gpu={budget} is below one sequence ({seq} tokens at the maximum "
                        f"lengths). Fix: ppo_max_token_len_per_gpu >= {seq}")
    accum = (math.ceil(per_rank / max(dyn_rows, 1)) if actor.use_dynamic_bsz else math.ceil(per_rank / micro))
    prompts = _count_prompts(cfg) if count_prompts else None
    spe = prompts // (data.gen_batch_size or tbs) if prompts is not None else None
    if prompts is not None and prompts < tbs:
        problems.append(f"the training files hold {prompts} prompts, fewer than train_batch_size={tbs}. Fix: "
                        f"train_batch_size <= {prompts}")
    total = cfg.trainer.total_training_steps or (spe * cfg.trainer.total_epochs if spe is not None else None)
    return Arithmetic(
        workers=w, prompts_per_step=tbs, samples_per_step=tbs * n, mini_batches_per_step=tbs / mbs,
        optimizer_steps_per_step=actor.ppo_epochs * tbs / mbs, samples_per_mini_batch=samples_mini,
        samples_per_rank=per_rank, micro_batch_rows=(min(dyn_rows, int(per_rank)) if actor.use_dynamic_bsz
                                                     else min(micro, int(per_rank) or micro)),
        grad_accumulation=accum, seq_len=seq, tokens_per_micro_batch=micro * seq, dynamic_bsz=actor.use_dynamic_bsz,
        token_budget=budget, rows_per_dynamic_micro_batch=dyn_rows, prompts=prompts, steps_per_epoch=spe,
        total_steps=total, problems=problems, seq_parallel=sp)


def _divisor_below(total: int, value: int) -> int:
    """The largest divisor of `total` not above `value` (a fix that keeps the user's scale)."""
    return max((d for d in range(1, max(min(value, total), 1) + 1) if total % d == 0), default=1)


@dataclass
class ModelShape:
    params: int
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int  # kv heads x head dim
    vocab: int
    lm_head: int = 0  # parameters of an LM head not tied to the embedding (a value model drops it)


def model_shape(path: str, trust_remote_code: bool = False) -> ModelShape:
    """Shape of the model at `path` from its config.json; parameters counted on the meta device (nothing loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, trust_remote_code=trust_remote_code)
    params = sum(p.numel() for p in model.parameters())
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    lm_head = head.weight.numel() if head is not None and head.weight is not embed.weight else 0
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    return ModelShape(params, hf.hidden_size, hf.num_hidden_layers, getattr(hf, "intermediate_size", 4 * hf.hidden_size),
                      kv * head_dim, hf.vocab_size, lm_head)


def memory_estimate(cfg: RLConfig, shape: ModelShape, arith: Arithmetic | None = None,
                    teacher_shape: ModelShape | None = None, critic_shape: ModelShape | None = None) -> dict[str, int]:
    """Peak bytes per rank by component (see the module doc), with `peak` their combination. `teacher_shape`: the
    distillation teacher's (default: read from algorithm.distill.teacher_path when set; 0 if unreadable);
    `critic_shape`: the value model's (default: read from critic.model.path when it differs from the actor's)."""
    arith = arith or batch_arithmetic(cfg, count_prompts=False)
    arr, data = cfg.actor_rollout_ref, cfg.data
    w = arith.workers
    lora = arr.model.lora_rank > 0 or bool(arr.model.lora_adapter_path)
    n = shape.params
    trainable = _lora_params(shape, arr.model.lora_rank or _adapter_rank(arr.model.lora_adapter_path)) if lora else n
    if lora:  # modules trained in full beside the adapters (the embedding / LM head: vocab x hidden each)
        saved = arr.model.modules_to_save or ()
        trainable += shape.vocab * shape.hidden * len({"lm_head", "embed_tokens"} & set(saved))
    need_ref = (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not lora
    b = 2 if arr.actor.dtype in ("bfloat16", "bf16") else 4
    rows, s = arith.micro_batch_rows, arith.seq_len
    resp = arr.rollout.response_length or data.max_response_length
    per_token_layer = (8 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate) * b
    activations = rows * s * shape.layers * per_token_layer + rows * resp * shape.vocab * 4 * 3
    d = cfg.algorithm.distill
    if (d.teacher_path or d.teachers) and d.loss_mode == "gjsd":
        activations += rows * resp * shape.vocab * 4 * 2  # the teacher's logits in the micro-batch's gjsd loss
    activations //= arith.seq_parallel  # Ulysses: each worker of a group holds 1/sp of the micro-batch's tokens
    rollout_rows = math.ceil((data.gen_batch_size or data.train_batch_size) * arr.rollout.n / w)
    b_roll = 2 if (arr.rollout.dtype in ("bfloat16", "bf16") and cfg.trainer.device == "cuda") else 4
    kv_cache = rollout_rows * s * shape.layers * 2 * shape.kv_dim * b_roll + rollout_rows * shape.vocab * 4 * 2
    out = {
        "weights": 4 * n // w,
        "reference": 4 * n // w if need_ref else 0,
        "gradients": 4 * trainable // w,
        "optimizer": int(state_bytes_per_param(arr.actor.optim, "actor_rollout_ref.actor.optim") * trainable) // w,
        "activations": activations,
        "kv_cache": kv_cache,
        "teacher": 4 * _teacher_params(cfg, teacher_shape),
        "prm": 12 * n // w + 4 * n if cfg.algorithm.adv_estimator == "prime" else 0,
        "runtime": RUNTIME_BYTES,
        **_critic(cfg, shape, critic_shape, arith),
    }
    out["peak"] = (out["weights"] + out["reference"] + out["teacher"] + out["prm"] + out["critic"] + out["optimizer"]
                   + out["runtime"] + max(out["gradients"] + out["activations"], out["critic_update"],
                                          out["kv_cache"]))
    return out


def _critic(cfg: RLConfig, shape: ModelShape, critic_shape: ModelShape | None, arith: Arithmetic) -> dict[str, int]:
    """The value model's resident bytes (weights + optimizer state) and its update's transient ones (gradients +
    activations), 0 without GAE."""
    if cfg.algorithm.adv_estimator != "gae":
        return {"critic": 0, "critic_update": 0}
    critic = cfg.critic
    if critic_shape is None:
        path = critic.model.path
        critic_shape = shape
        if path and path != cfg.actor_rollout_ref.model.path:
            try:
                critic_shape = model_shape(path, critic.model.trust_remote_code)
            except Exception:  # noqa: BLE001 - unreadable critic config: estimate it with the actor's shape
                critic_shape = shape
    w, h = arith.workers, critic_shape.hidden
    n = critic_shape.params - critic_shape.lm_head + h + 1
    rank = critic.model.lora_rank or _adapter_rank(critic.model.lora_adapter_path)
    trainable = _lora_params(critic_shape, rank) + h + 1 if rank else n
    rows = min(critic.ppo_micro_batch_size_per_gpu or arith.micro_batch_rows, math.ceil(arith.samples_per_rank))
    c, b = critic_shape, 2 if critic.dtype in ("bfloat16", "bf16") else 4
    activations = rows * arith.seq_len * c.layers * (8 * c.hidden + 2 * c.kv_dim + 4 * c.intermediate) * b
    return {"critic": (4 * n + int(state_bytes_per_param(critic.optim, "critic.optim") * trainable)) // w,
            "critic_update": 4 * trainable // w + activations}


def _teacher_params(cfg: RLConfig, teacher_shape: ModelShape | None) -> int:
    """Parameters of the distillation teacher (all of them, with several teachers: each is a frozen copy per worker)."""
    d = cfg.algorithm.distill
    paths = [d.teacher_path] if d.teacher_path else list(d.teachers.values())
    if teacher_shape is not None:
        return teacher_shape.params * len(paths)
    total = 0
    for path in paths:
        try:
            total += model_shape(path, cfg.actor_rollout_ref.model.trust_remote_code).params
        except Exception:  # noqa: BLE001 - unreadable teacher config: the estimate leaves it out
            continue
    return total


def _adapter_rank(path: str | None) -> int:
    """The rank in a saved LoRA adapter's adapter_config.json (0 if unreadable: the estimate leaves it out)."""
    import json
    from pathlib import Path

    try:
        return int(json.loads((Path(path or "").expanduser() / "adapter_config.json").read_text()).get("r") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _lora_params(shape: ModelShape, rank: int) -> int:
    """LoRA adapters on every linear layer of the blocks: r (in + out) per matrix."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    per_layer = rank * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)
    return per_layer * shape.layers


def _mib(x: float) -> str:
    return f"{x / MiB:,.0f} MiB" if x >= 10 * MiB else f"{x / MiB:.1f} MiB"


def explain(cfg: RLConfig) -> str:
    """The multi-line report of `tiller config explain`."""
    a = batch_arithmetic(cfg)
    n = cfg.actor_rollout_ref.rollout.n
    lines = [
        "batch arithmetic (per RL step)",
        f"  prompts per step           {a.prompts_per_step}   (data.train_batch_size)",
        f"  samples per step           {a.samples_per_step}   (x rollout.n = {n})",
        f"  mini-batches per step      {a.mini_batches_per_step:g}   (train_batch_size / ppo_mini_batch_size; "
        f"{a.samples_per_mini_batch} samples each)",
        f"  optimizer steps per step   {a.optimizer_steps_per_step:g}   (x ppo_epochs = "
        f"{cfg.actor_rollout_ref.actor.ppo_epochs})",
        f"  data-parallel workers      {a.data_parallel}"
        + (f"   ({a.workers} workers / {a.seq_parallel} sequence-parallel: each micro-batch split over "
           f"{a.seq_parallel})" if a.seq_parallel > 1 else ""),
        f"  samples per rank           {a.samples_per_rank:g}   per mini-batch",
    ]
    if a.dynamic_bsz:
        lines += [f"  token budget               {a.token_budget} padded tokens per micro-batch (use_dynamic_bsz): "
                  f"{a.rows_per_dynamic_micro_batch} rows at the maximum length {a.seq_len}",
                  f"  micro-batches per rank     >= {a.grad_accumulation} per mini-batch (grad accumulation; more "
                  "when lengths are long, fewer when short)"]
    else:
        lines += [f"  micro-batches per rank     {a.grad_accumulation} per mini-batch of "
                  f"{cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu} rows (grad accumulation factor)",
                  f"  micro-batches per step     {a.grad_accumulation * a.data_parallel} per mini-batch over all "
                  "ranks",
                  f"  tokens per micro-batch     {a.tokens_per_micro_batch} at the maximum lengths "
                  f"({a.seq_len} = prompt + response)"]
    if a.steps_per_epoch is not None:
        lines.append(f"  steps per epoch            {a.steps_per_epoch}   ({a.prompts} training prompts)")
    lines.append(f"  total steps                {a.total_steps if a.total_steps is not None else 'unknown (training files not readable)'}")
    lines += _async_lines(cfg)
    lines += _memory_lines(cfg, a)
    if a.problems:
        lines.append("problems")
        lines += [f"  - {p}" for p in a.problems]
    return "\n".join(lines) + "\n"


def _async_lines(cfg: RLConfig) -> list[str]:
    """Asynchronous RL: how far generation runs ahead, and where it runs (one process, or a Ray rollout pool)."""
    at = cfg.async_training
    if not async_enabled(cfg):
        return []
    ahead = batches_per_sync(at.staleness_threshold, at.trigger_parameter_sync_step)
    lines = ["asynchronous RL (async_training)",
             f"  generated ahead            at most {ahead} step batches per weight sync (every "
             f"{at.trigger_parameter_sync_step} step(s)); samples at most "
             f"{max_age(at.staleness_threshold, at.trigger_parameter_sync_step)} version(s) old"
             + ("; partial rollouts (new weights between decode steps)" if at.partial_rollout else "")]
    if cfg.trainer.backend == "ray":
        pool = cfg.rollout
        lines.append(f"  rollout pool               {pool['nnodes'] * pool['n_gpus_per_node']} workers of their own "
                     f"(rollout.nnodes x rollout.n_gpus_per_node = {pool['nnodes']} x {pool['n_gpus_per_node']}); the "
                     f"{cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node} trainer workers only update")
    else:
        lines.append("  rollout producer           a thread of this process with its own copy of the weights")
    return lines


def _memory_lines(cfg: RLConfig, a: Arithmetic) -> list[str]:
    path = cfg.actor_rollout_ref.model.path
    if not path:
        return ["peak memory per rank: no actor_rollout_ref.model.path to read"]
    try:
        check_model_path(path, "model")
    except UserError as err:  # a placeholder path, a hub id offline: no hub error text, say what was skipped
        return [f"peak memory per rank: no config.json at {path}: memory estimate skipped ({err})"]
    if Path(path).is_dir() and not (Path(path) / "config.json").exists():
        return [f"peak memory per rank: no config.json at {path}: memory estimate skipped"]
    try:
        shape = model_shape(path, cfg.actor_rollout_ref.model.trust_remote_code)
    except Exception as err:  # a hub id not cached, a custom architecture: say so, do not fail the report
        return [f"peak memory per rank: cannot read {path}/config.json ({type(err).__name__}: {err})"]
    mem = memory_estimate(cfg, shape, a)
    lines = [f"peak memory per rank (estimate; {shape.params / 1e6:.1f}M parameters, {shape.layers} layers, "
             f"hidden {shape.hidden}, vocab {shape.vocab})"]
    for key in ("weights", "reference", "teacher", "prm", "critic", "gradients", "optimizer", "activations",
                "critic_update", "kv_cache", "runtime"):
        if mem[key]:
            lines.append(f"  {key.replace('_', ' '):<26} {_mib(mem[key])}")
    lines.append(f"  {'peak':<26} {_mib(mem['peak'])}")
    return lines


def one_line(cfg: RLConfig) -> str:
    """The start-up line of `tiller rl`: the batch arithmetic in one line (and the memory estimate if readable)."""
    a = batch_arithmetic(cfg)
    micro = (f"<= {a.token_budget} tokens per micro-batch" if a.dynamic_bsz
             else f"{a.grad_accumulation} micro-batches of {cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}")
    line = (f"tiller: {a.prompts_per_step} prompts x {cfg.actor_rollout_ref.rollout.n} = {a.samples_per_step} samples "
            f"per step; {a.mini_batches_per_step:g} mini-batches x {cfg.actor_rollout_ref.actor.ppo_epochs} epochs = "
            f"{a.optimizer_steps_per_step:g} optimizer steps; per rank {a.samples_per_rank:g} samples = {micro}; "
            f"{a.total_steps if a.total_steps is not None else '?'} steps")
    try:
        mem = memory_estimate(cfg, model_shape(cfg.actor_rollout_ref.model.path,
                                               cfg.actor_rollout_ref.model.trust_remote_code), a)
        line += f"; peak memory per rank ~{_mib(mem['peak'])} (`tiller config explain`)"
    except Exception:
        pass
    if a.problems:
        line += f"; {len(a.problems)} batch-size problem(s): see `tiller config explain`"
    return line


__all__ = ["Arithmetic", "ModelShape", "batch_arithmetic", "memory_estimate", "model_shape", "explain", "one_line"]
