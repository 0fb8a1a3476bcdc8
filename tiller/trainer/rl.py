"""The RL driver: PPO and the GRPO family (GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++, OPO, GPG, DAPO-style).

One step, in the order `RLTrainer.train_step` runs it (each phase a named timer, `timing_s/<name>`):

    prompts (seeded sampler)  -> gen: rollout.n samples per prompt (token ids + sampling logprobs)
    -> gen_max: greedy baseline (ReMax only)      -> reward: scorer / custom fn, on the last response token
    -> filter_groups (optional, DAPO dynamic sampling: more generation rounds until train_batch_size
       groups with a varying metric are collected)  -> balance_batch (optional: equal tokens per worker)
    -> old_log_prob (skipped when the update is exactly on-policy and nothing else needs it)
    -> ref (KL only) -> teacher (on-policy distillation only: the teacher's logprobs of the sampled tokens)
    -> update_prm + prm_rewards (PRIME only: the implicit PRM learns from the outcomes, then scores the tokens)
    -> values (GAE only)
    -> adv: optional KL in reward, rollout correction (optional: TIS weights, rejection mask), then the
       advantage estimator
    -> update_critic (GAE) -> update_actor (ppo_epochs x mini-batches x micro-batches)
    -> sync_weights (actor -> rollout engine) -> metrics, validation, checkpoint.

Asynchronous RL (`async_training.staleness_threshold` > 0 or `trigger_parameter_sync_step` > 1): the gen,
reward and filter_groups phases run ahead in a producer thread (`tiller.trainer.async_rollout`) with its own
copy of the weights; `train_step` takes its batch from the producer's queue (stale samples dropped) and the
sync_weights phase publishes the weights to it. The behaviour (old) logprobs are then the rollout's own, unless
a decoupled rollout correction asks for recomputed ones (AReaL's decoupled PPO). staleness_threshold=0 with
trigger 1 is the synchronous loop itself. With trainer.backend=ray the producer's generation runs on a rollout
pool of its own (`_start_rollout_pool`, verl fully-async's rollouter): the copy of the weights lives there.

Rollout-vs-actor mismatch (`training/rollout_probs_diff_{mean,max,std}`,
`training/rollout_actor_probs_pearson_corr`, verl's names) is logged every step for every engine: from
`old_log_probs` when they are computed, else by the actor from its update's own (detached, on-policy)
logprobs of the same tokens. A rollout engine whose weights lag the actor shows up there at once.

PPO: Schulman et al. 2017 (arXiv 1707.06347) with GAE; GRPO: Shao et al. 2024 (arXiv 2402.03300);
the design follows verl's `RayPPOTrainer` (HybridFlow, Sheng et al. 2024, arXiv 2409.19256): the driver
holds data, rewards and advantages; workers (`tiller.workers`) hold models and run through
`tiller.distributed` worker groups (in-process for backend=local, Ray actors for backend=ray).

Deviations from verl: the reward runs in the driver process (no separate reward worker); the critic's
checkpoint lives in `checkpoints/critic/global_step_N` next to the actor's; when `filter_groups` reaches
`max_num_gen_batches` rounds without train_batch_size groups, the step trains on the groups it has (verl
raises an error); the KL-in-reward controller is updated once per step, not once per generation round.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from tiller.algos.advantages import get_advantage_estimator
from tiller.algos.entropy import AdaptiveEntropyController
from tiller.algos.kl import apply_kl_in_reward, build_kl_controller
from tiller.algos.pf_ppo import pf_ppo_resample
from tiller.algos.prime import prime_token_rewards
from tiller.algos.rollout_correction import rollout_correction, rollout_mismatch_metrics
from tiller.config import to_dict
from tiller.config.edge import report_noop_keys
from tiller.config.explain import one_line
from tiller.config.schema import RLConfig
from tiller.config.validate import async_enabled
from tiller.data.rl_dataset import build_rl_dataset, PromptSampler
from tiller.data.seqlen import balanced_order
from tiller.distributed import create_worker_group, WorkerError
from tiller.errors import ConfigError, DataError
from tiller.models.checkpoint import list_checkpoints, resolve_checkpoint
from tiller.models import routing
from tiller.models.chat_template import set_chat_template
from tiller.models.loading import is_vision_checkpoint, load_tokenizer, model_config, unsupported_vision_model
from tiller.models.vision import load_processor
from tiller.protocol import Batch
from tiller.rewards import build_reward_manager
from tiller.rewards.registry import check_ground_truths, ground_truth_problem
from tiller.rewards.types import RewardRequest
from tiller.rollout.base import shaping_of
from tiller.rollout.verl_agent_loop import build_rollout_loop
from tiller.rollout.episodes import renumber_episodes
from tiller.tracking import CONSOLE_KEYS, timer, Tracker
from tiller.tracking.report import write_plots
from tiller.trainer import hooks as step_hooks
from tiller.trainer.async_rollout import RolloutProducer, ThreadSharing, staleness_filter, trainer_version
from tiller.trainer.episode_merge import concat_episode_batches, merge_episode_parts
from tiller.trainer.flops import actor_mfu, device_peak_flops
from tiller.trainer.generations import dump_generations, generation_rows, per_sample_extras
from tiller.trainer.rollout_skip import RolloutSkip
from tiller.trainer.rl_metrics import (
    data_metrics, moe_expert_counts, moe_load_balance_metrics, tool_metrics, TOOL_FIELDS, validation_metrics,
)
from tiller.trainer.rundir import (
    acquire_run_dir, claim_run_dir, clear_records, release_run_dir, run_records, sampling_changes, sampling_settings,
)
from tiller.workers.actor import ActorRolloutRefWorker
from tiller.workers.common import prepare_process
from tiller.workers.critic import CriticWorker, value_metrics

CRITIC_SUBDIR = "critic"


def _print_batch_line(cfg) -> None:
    """`tiller config explain`'s one-line form on stderr at start-up."""
    import sys

    print(one_line(cfg), file=sys.stderr)


class RLTrainer:
    """Runs `cfg` end to end: `RLTrainer(cfg).fit()` returns the last step's metrics."""

    def __init__(self, cfg: RLConfig, reward_fn=None, tool_loop=None):
        # reward_fn: an in-process scorer (`score(list[RewardRequest]) -> ScoreBatch`, e.g. tiller.trl's reward
        # functions) in place of the config's reward manager; the rest of the reward pipeline applies as usual.
        # tool_loop: an in-process multi-turn loop (tiller.trl's tools / environments) in place of multi_turn's
        self.in_process_reward = reward_fn
        self.given_tool_loop = tool_loop
        if reward_fn is not None and cfg.trainer.backend == "ray":
            raise ConfigError("trainer.backend=ray with an in-process reward function: the reward runs in the driver "
                              "process, but this front end drives the local backend only (trainer.backend=local)")
        if tool_loop is not None and (cfg.trainer.backend == "ray" or cfg.actor_rollout_ref.rollout.multi_turn.enable):
            raise ConfigError("an in-process tool loop (a TRL script's tools) runs with trainer.backend=local and "
                              "without actor_rollout_ref.rollout.multi_turn.enable")
        self.run_dir = Path(cfg.trainer.default_local_dir).expanduser()
        acquire_run_dir(self.run_dir)  # one process a run dir: a second one refuses, naming the holder
        try:
            self._set_up(cfg)
        except BaseException:
            # a run that refuses to start leaves no trace: the lock goes, and the dirs its acquire made if empty
            release_run_dir(self.run_dir, discard=True)
            raise

    def _set_up(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        data, arr, algo, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
        report_noop_keys(cfg)  # one line: the verl keys the user set that have no effect here
        _print_batch_line(cfg)  # one line: what the batch sizes mean together, and the memory estimate
        prepare_process(tr)
        if not arr.model.path:
            raise ConfigError("actor_rollout_ref.model.path is empty: give a Hugging Face model dir "
                              "(or run `tiller demo` for the built-in model and task)")
        # verl's multi_turn.enable: multi-turn tool rollouts (tiller.rollout.agent, as tiller eval runs them); its
        # settings and tools checked, and the tools' schemas rendered into the prompts, before a model loads
        self.tool_loop = self.given_tool_loop or build_rollout_loop(arr.rollout, data.apply_chat_template_kwargs,
                                                                    config=cfg)
        self.custom_loops = bool(arr.rollout.agent.agent_loop_config_path)  # verl's agent loops read raw_prompt
        if self.tool_loop is not None:
            _refuse_with_multi_turn(cfg)
        torch.manual_seed(tr.seed)
        self.n = arr.rollout.n
        self.prompt_width = arr.rollout.prompt_length or data.max_prompt_length
        self.response_width = arr.rollout.response_length or data.max_response_length
        self.ckpt_root = self.run_dir / "checkpoints"
        self._claim_run_dir()
        tok_path = data.tokenizer or arr.model.tokenizer_path or arr.model.path
        self.tokenizer = load_tokenizer(tok_path, padding_side="left", trust_remote_code=arr.model.trust_remote_code)
        set_chat_template(self.tokenizer, arr.model.custom_chat_template)  # verl's model.custom_chat_template
        # rule scoring (no custom function, reward model or remote server) needs every row's ground truth
        rm_cfg = cfg.reward_model
        self.agent = bool(arr.rollout.agent.path or arr.rollout.agent.env_path)  # episodes: the agent gives rewards
        rules = not (cfg.custom_reward_function.path or rm_cfg.enable or rm_cfg.remote_url or self.agent
                     or self.in_process_reward is not None)
        if (self.agent or self.custom_loops) and not data.return_raw_chat:  # the agent gets the chat messages
            from dataclasses import replace

            data = replace(data, return_raw_chat=True)
        # a vision-language model's processor renders and encodes image prompts (rows with data.image_key)
        self.processor = None
        unsupported = unsupported_vision_model(arr.model.path)  # e.g. GLM-4.1V: refused before its rows are read
        if unsupported is not None:
            raise ConfigError(f"actor_rollout_ref.model.path={unsupported}")
        if is_vision_checkpoint(arr.model.path):
            self.processor = load_processor(arr.model.path, tokenizer=self.tokenizer,
                                            trust_remote_code=arr.model.trust_remote_code)
            set_chat_template(self.tokenizer, arr.model.custom_chat_template, self.processor)
        schemas = [t.schema for t in self.tool_loop.tools.values()] \
            if self.tool_loop is not None and self.tool_loop.tools is not None else None
        names = self.tool_loop.agent_names() if hasattr(self.tool_loop, "agent_names") else ()
        # several distillation teachers: each training row's teacher_key value picks its teacher (checked here, once)
        self.teacher_keys = sorted(algo.distill.teachers)
        self.train_ds = build_rl_dataset(data, self.tokenizer, data.train_files, max_samples=data.max_samples,
                                         require_ground_truth=rules, processor=self.processor, tool_schemas=schemas,
                                         agent_names=names,
                                         route_key=algo.distill.teacher_key if self.teacher_keys else None)
        for item in self.train_ds.items if self.teacher_keys else ():
            if item.route not in algo.distill.teachers:
                raise DataError(f"{item.where}: {algo.distill.teacher_key}={item.route!r} has no teacher "
                                f"(algorithm.distill.teachers: {', '.join(map(repr, self.teacher_keys))})")
        self.val_ds = None
        if data.val_files:
            self.val_ds = build_rl_dataset(data, self.tokenizer, data.val_files, max_samples=data.val_max_samples,
                                           what="data.val_files", require_ground_truth=rules,
                                           processor=self.processor, tool_schemas=schemas, agent_names=names)
        # rule scoring: a ground truth of the wrong type for its scorer is refused here, or (count) scored 0 and counted
        self.count_bad_ground_truth = rules and rm_cfg.bad_ground_truth == "count"
        self.bad_ground_truth_total = 0
        for what, ds in (("data.train_files", self.train_ds), ("data.val_files", self.val_ds)):
            if rules and ds is not None:
                check_ground_truths(ds.items, what, rm_cfg.bad_ground_truth)
        # prompts are drawn data.gen_batch_size at a time (DAPO's dynamic sampling may draw several per step)
        self.sampler = PromptSampler(len(self.train_ds), data.gen_batch_size or data.train_batch_size,
                                     shuffle=data.shuffle, seed=data.seed)
        self.total_steps = tr.total_training_steps or self.sampler.steps_per_epoch * tr.total_epochs
        self.rollout_skip = RolloutSkip(cfg)  # verl's skip.rollout: listed steps' rollouts dumped / loaded
        if self.total_steps <= 0:
            raise ConfigError("no training steps: set trainer.total_training_steps or trainer.total_epochs > 0")
        self.use_critic = algo.adv_estimator == "gae"
        self._refuse_text_models_for_images(cfg)
        self.need_ref = arr.actor.use_kl_loss or algo.use_kl_in_reward
        # on-policy distillation: teacher logprobs each step
        self.need_teacher = bool(algo.distill.teacher_path or algo.distill.teachers)
        self.prime = algo.adv_estimator == "prime"  # PRIME: an implicit PRM trained each step (algorithm.prime)
        # on-policy (one epoch, one mini-batch): the update's own detached logprobs are the old ones
        self.on_policy = arr.actor.ppo_epochs == 1 and arr.actor.ppo_mini_batch_size == data.train_batch_size
        rc = algo.rollout_correction
        # bypass mode (verl): the rollout engine's logprobs are the old ones; the correction is inside the loss
        self.bypass = rc.bypass_mode
        self.rollout_correction = (rc.rollout_is is not None or rc.rollout_rs is not None) and not self.bypass
        # old logprobs are computed unless the update's own detached logprobs can stand in for them (the optimal
        # token baseline also needs the forward's sum of squared probabilities)
        self.need_sum_pi2 = "optimal_token_baseline" in algo.adv_estimator
        self.need_old_log_prob = not self.bypass and (not self.on_policy or algo.use_kl_in_reward
                                                      or self.rollout_correction or self.need_sum_pi2)
        # asynchronous RL (async_training, tiller.trainer.async_rollout): a producer thread generates ahead
        self.async_on = async_enabled(cfg)
        self.producer = None
        self._thread_sharing = None  # async on the CPU: the trainer borrows the producer's idle threads
        self._threads_before = None  # async: the trainer thread's torch threads before the producer started
        self._sampler_state = None  # async: the sampler's state after the current step's prompts
        # async without a decoupled correction: the behaviour logprobs (the rollout's own) are the old ones;
        # on-policy updates then measure the mismatch with their own first forward (no extra pass)
        self.behaviour_is_rollout = self.async_on and not self.bypass and not self.rollout_correction
        self._mismatch_in_update = self.behaviour_is_rollout and not self.need_old_log_prob
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl,
                                           algo.kl_ctrl.horizon)
        self.entropy_ctrl = None
        ae = arr.actor.adaptive_entropy
        if ae.enable:
            self.entropy_ctrl = AdaptiveEntropyController(ae.init_coeff, ae.target_entropy, ae.delta, ae.max_coeff,
                                                          ae.min_coeff, ae.inclusive)
        self._last_entropy = float("inf")
        self.reward_fn = self._build_reward_fn()
        self._start_workers()
        if self.async_on and self.rollouter is None:  # (in one process: a second engine in the actor's worker)
            self.actor.execute("start_producer_engine")
        # prompts are sampled in this many equal chunks, each with its own seed (ActorRolloutRefWorker):
        # one per rank by default; set it to N to reproduce an N-rank run's samples in one process
        self.rollout_seed_chunks = self.world_size
        self.global_step = 0
        self._moe_counts: torch.Tensor | None = None  # rollout.moe_load_balance_metrics_interval: since the last log
        self.tracker = None
        self.val_history: list[tuple[int, dict[str, float]]] = []  # (step, validation metrics)
        if self._replaced_records:  # trainer.overwrite=true, once nothing above refused the run
            clear_records(self.run_dir, self._replaced_records)

    # --------------------------------------------------------------------------------- set-up
    def _build_reward_fn(self):
        return build_reward_manager(self.cfg, self.tokenizer, base=self.in_process_reward)

    def _start_workers(self) -> None:
        tr = self.cfg.trainer
        self.world_size = tr.nnodes * tr.n_gpus_per_node if tr.backend == "ray" else 1
        # Ulysses sequence parallelism: groups of sp ranks share the rows of the actor's forwards and update
        sp = self.cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size or 1
        self.sp = sp if self.world_size > 1 else 1
        self.actor_dp = self.world_size // self.sp if self.world_size % self.sp == 0 else self.world_size
        self.actor_dp_call = {"dispatch": "dp", "replicas": self.sp}
        csp = (self.cfg.critic.ulysses_sequence_parallel_size or 1) if self.world_size > 1 and self.use_critic else 1
        self.critic_dp = self.world_size // csp if self.world_size % csp == 0 else self.world_size
        self.critic_dp_call = {"dispatch": "dp", "replicas": csp}
        for role, sp, dp, key in (("actor", self.sp, self.actor_dp, "actor_rollout_ref.actor"),
                                  ("critic", csp, self.critic_dp, "critic")):
            if sp > 1:
                print(f"tiller: {role}: {self.world_size} workers = {dp} data-parallel x {sp} sequence-parallel "
                      f"({key}.ulysses_sequence_parallel_size)", file=sys.stderr)
        opts = dict(backend=tr.backend, world_size=self.world_size, cpus_per_worker=tr.cpus_per_worker,
                    ray_address=tr.ray_address)
        if tr.backend == "ray" and tr.device == "cuda":
            opts["gpus_per_worker"] = 1
        for size, key in ((self.cfg.data.train_batch_size, "data.train_batch_size"),
                          (self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
                           "actor_rollout_ref.actor.ppo_mini_batch_size")):
            if (size * self.n) % self.world_size:
                raise ConfigError(f"{key} x rollout.n = {size * self.n} samples must divide evenly over "
                                  f"{self.world_size} workers")
        agent_app = None
        if self.cfg.actor_rollout_ref.rollout.agent.path:
            # import cost: fastapi and the OpenAI server, only for agent rollouts
            from tiller.serve.app import agent_app
        pool = self.async_on and tr.backend == "ray"  # asynchronous RL on Ray: a rollout pool generates
        self.actor = create_worker_group(
            ActorRolloutRefWorker, dict(config=self.cfg, total_training_steps=self.total_steps,
                                        need_ref=self.need_ref, agent_app=agent_app, lazy_rollout=pool,
                                        **({"tool_loop": self.given_tool_loop} if self.given_tool_loop else {})),
            name="actor_rollout_ref", **opts)
        self.critic = None
        if self.use_critic:
            self.critic = create_worker_group(CriticWorker, dict(config=self.cfg, total_training_steps=self.total_steps),
                                              name="critic", colocate_with=self.actor if tr.backend == "ray" else None,
                                              **opts)
        self.rollouter = None  # asynchronous RL on Ray: the rollout pool (`_start_rollout_pool`)
        self._board = None  # ... and, with partial rollouts, where its workers find newer weights
        if pool:  # (the trainer's own engines start at the first validation, if any)
            self.rollouter = self._start_rollout_pool(agent_app)

    def _start_rollout_pool(self, agent_app):
        """Asynchronous RL on Ray (verl fully-async's standalone rollout): rollout.nnodes x rollout.n_gpus_per_node
        workers of their own (ActorRolloutRefWorker role "rollout": the engine, no optimizer, no process group)
        generate while the trainer's workers update; each weight sync the trainer's rank 0 puts its full weights
        in Ray's object store once and every rollout worker loads them from there (`_publish`)."""
        tr, pool = self.cfg.trainer, self.cfg.rollout
        size = int(pool["nnodes"]) * int(pool["n_gpus_per_node"])
        self.pool_seed_chunks = size  # the pool's samples as `size` seeded chunks (a one-process run can match them)
        print(f"tiller: asynchronous RL on Ray: {self.world_size} trainer worker(s) (trainer.nnodes x "
              f"trainer.n_gpus_per_node) and {size} rollout worker(s) of their own (rollout.nnodes x "
              "rollout.n_gpus_per_node)", file=sys.stderr)
        kwargs = dict(config=self.cfg, total_training_steps=self.total_steps, agent_app=agent_app, role="rollout")
        if self.cfg.async_training.partial_rollout:  # workers take newer weights between decode steps from a board
            # import cost: Ray, only for a Ray rollout pool
            from tiller.distributed.ray_group import WeightBoard

            self._board = WeightBoard()
        return create_worker_group(ActorRolloutRefWorker, kwargs, name="rollout", backend="ray", world_size=size,
                                   cpus_per_worker=tr.cpus_per_worker, gpus_per_worker=1 if tr.device == "cuda" else 0,
                                   ray_address=tr.ray_address, process_group=False)

    def _open_tracker(self):
        tr = self.cfg.trainer
        keys = dict(CONSOLE_KEYS)
        n_val = self.cfg.actor_rollout_ref.rollout.val_kwargs.n
        for ds in sorted({it.data_source for it in self.val_ds.items} if self.val_ds else ()):
            if "/" in ds:  # the console shows plain names itself; nested ones (tiller/arithmetic) are added here
                keys[f"val-core/{ds}/acc/mean@{n_val}"] = f"val/{ds}"
        return Tracker(self.run_dir, loggers=tuple(tr.logger), project=tr.project_name,
                       experiment=tr.experiment_name, config=to_dict(self.cfg), total_steps=self.total_steps,
                       resume_from_step=self.global_step if self.global_step > 0 else None, console_keys=keys)

    # ----------------------------------------------------------------------------------- loop
    def fit(self) -> dict[str, float]:
        """Resume if asked, validate, train `total_steps` steps; returns the last logged metrics."""
        tr = self.cfg.trainer
        self._maybe_resume()
        self.tracker = self._open_tracker()
        last: dict[str, float] = {}
        if self.async_on and not tr.val_only:
            self._start_producer()
        try:
            if self.val_ds is not None and (tr.val_before_train or tr.val_only) and self.global_step == 0:
                last = self.validate()
                self.tracker.log(last, step=0)
                if tr.val_only:
                    return last
            progress = self._progress_bar()
            hooks = step_hooks.current()  # a front end's callbacks (tiller.trl)
            if hooks is not None:
                worker = getattr(self.actor, "worker", None)  # in-process actor: its live module and optimizer
                hooks.begin({"total": self.total_steps, "start": self.global_step, "tokenizer": self.tokenizer,
                             "model": getattr(worker, "module", None), "optimizer": getattr(worker, "optimizer", None),
                             "lr_scheduler": getattr(worker, "scheduler", None)})
            start, per_epoch = self.global_step, max(1, self.sampler.steps_per_epoch)
            while self.global_step < self.total_steps:
                if hooks is not None:
                    if self.global_step == start or self.global_step % per_epoch == 0:
                        hooks.epoch_begin(self.global_step // per_epoch)
                    hooks.step_begin(self.global_step)
                self.global_step += 1
                metrics = self.train_step()
                progress.update(1)
                is_last = self.global_step >= self.total_steps
                validated = saved = None
                if self.val_ds is not None and ((tr.test_freq > 0 and self.global_step % tr.test_freq == 0) or is_last):
                    with timer("testing", metrics):
                        validated = self.validate()
                        metrics.update(validated)
                if (tr.save_freq > 0 and self.global_step % tr.save_freq == 0) or is_last:
                    with timer("save_checkpoint", metrics):
                        saved = self.save_checkpoint()
                metrics["training/global_step"] = self.global_step
                metrics["training/epoch"] = self._sampler_state_now()["epoch"]
                self.tracker.log(metrics, step=self.global_step)
                last = metrics
                if hooks is None:
                    continue
                asked = hooks.step(self.global_step, metrics)  # (transformers' order: step, log, evaluate, save)
                validated, saved = self._serve(hooks, asked, validated, saved)
                if saved is not None:
                    hooks.saved(self.global_step, saved)
                if self.global_step % per_epoch == 0 or is_last or asked.stop:
                    more = hooks.epoch_end(self.global_step)  # (then what it asks, as transformers does)
                    validated, again = self._serve(hooks, more, validated, saved)
                    if again is not saved:
                        hooks.saved(self.global_step, again)
                    asked.stop = asked.stop or more.stop
                if asked.stop:
                    print(f"training stopped at step {self.global_step} of {self.total_steps} (a callback asked)")
                    break
            if hooks is not None:
                hooks.end(self.global_step, last)
            progress.close()
        finally:
            if self._board is not None:  # a pool worker still generating abandons it at its next question
                self._board.stop()
            if self.producer is not None:
                self.producer.stop()
            if self._thread_sharing is not None:
                self.actor.execute("set_thread_poll", None)
                for group in (self.actor, self.critic):
                    if group is not None:
                        group.execute("set_lent_lanes", 0)
                self._thread_sharing = None
            if self._threads_before is not None:
                torch.set_num_threads(self._threads_before)
                self._threads_before = None
            self.tracker.close()
        if "jsonl" in tr.logger:  # the run's main curves as plots/main.png (`tiller report` draws them all)
            write_plots(self.run_dir, families=False)
        if self.bad_ground_truth_total:
            print(f"reward/bad_ground_truth: {self.bad_ground_truth_total} samples of this run scored 0 because "
                  "their ground truth has the wrong type for their scorer (reward_model.bad_ground_truth=count)",
                  file=sys.stderr)
        return last

    def _progress_bar(self):
        """trainer.progress: a tqdm bar of the training steps on a terminal (off when stderr is not a TTY)."""
        import sys

        from tqdm.auto import tqdm

        on = self.cfg.trainer.progress and sys.stderr.isatty()
        return tqdm(total=self.total_steps, initial=self.global_step, desc="tiller rl", unit="step",
                    disable=not on, dynamic_ncols=True, leave=False)

    def train_step(self) -> dict[str, float]:
        """One RL step (see the module docstring); returns its metrics."""
        m: dict[str, float] = {}
        actor, critic = self.actor, self.critic
        if self.in_process_reward is not None and hasattr(self.in_process_reward, "global_step"):
            self.in_process_reward.global_step = self.global_step  # TRL's reward functions read trainer_state
        with timer("step", m):
            batch = self._take_batch(m)  # gen (+ gen_max) + reward; DAPO: rounds until enough groups pass
            if not len(batch):  # no group passed algorithm.filter_groups (within the cap): nothing to train on
                self._publish_weights()  # async: the version still advances, or the producer's schedule stalls
                return m
            if self.cfg.trainer.balance_batch and self.world_size > 1:
                batch = self._balance_batch(batch, m)
            if self.bypass and "old_log_probs" not in batch:
                batch["old_log_probs"] = batch["rollout_log_probs"]
            if self.need_old_log_prob and "old_log_probs" not in batch:
                with timer("old_log_prob", m):
                    batch = batch.union(actor.execute("compute_log_prob", batch, **self.actor_dp_call))
            if "old_log_probs" in batch:
                m.update(self._mismatch_metrics(batch))
            if self.behaviour_is_rollout:  # async: the ratio's old policy is the one that sampled (its logprobs)
                batch["old_log_probs"] = batch["rollout_log_probs"]
            if self.need_ref and "ref_log_prob" not in batch:
                with timer("ref", m):
                    batch = batch.union(actor.execute("compute_ref_log_prob", batch, **self.actor_dp_call))
            if self.need_teacher:
                with timer("teacher", m):
                    if self.teacher_keys:  # several teachers: each sample's, by its prompt's teacher_key value
                        batch["teacher_index"] = self._teacher_index(batch)
                    batch = batch.union(actor.execute("compute_teacher_log_prob", batch, **self.actor_dp_call))
            if self.prime:  # PRIME: the implicit PRM learns from this batch's outcomes, then scores its tokens
                with timer("update_prm", m):
                    m.update(actor.execute("update_prm", self._prm_batch(batch), **self.actor_dp_call))
                with timer("prm_rewards", m):
                    batch = batch.union(actor.execute("compute_prm_log_ratio", batch, **self.actor_dp_call))
            if self.use_critic:
                with timer("values", m):
                    batch = batch.union(critic.execute("compute_values", batch, **self.critic_dp_call))
            with timer("adv", m):
                baseline = batch["reward_baselines"] if "reward_baselines" in batch else None
                self._compute_advantage(batch, m, baseline)
                if self.cfg.actor_rollout_ref.actor.mask_truncated_responses:
                    self._mask_truncated(batch, m)
                if self.cfg.algorithm.use_pf_ppo:  # PF-PPO: the update sees samples redrawn by reward
                    batch = self._pf_ppo_resample(batch, m)
            train_batch = self._for_update(batch)
            if self.use_critic and len(train_batch):
                with timer("update_critic", m):
                    m.update(critic.execute("update_critic", train_batch, **self.critic_dp_call))
            if self.global_step > self.cfg.trainer.critic_warmup and len(train_batch):
                with timer("update_actor", m):
                    m.update(actor.execute("update_actor", train_batch, **self.actor_dp_call))
                self._update_entropy_ctrl(m)
            if self._thread_sharing is not None:
                m.update(self._thread_sharing.take_stats())
            with timer("sync_weights", m):
                actor.execute("sync_rollout_weights")
                self._publish_weights()
        m.update(self._data_metrics(batch, m))
        if self.cfg.trainer.rollout_data_dir and len(batch):
            with timer("dump_rollout_generations", m):
                extras = list(batch["reward_extras"]) if "reward_extras" in batch else [{}] * len(batch)
                dump_generations(self.cfg.trainer.rollout_data_dir, self.global_step,
                                 self._dump_rows(batch, batch["score"].tolist(), extras))
        return m

    def _dump_rows(self, batch: Batch, scores: list[float], extras: list[dict]) -> list[dict]:
        """The samples of `batch` as trainer.rollout_data_dir / validation_data_dir records
        (`tiller.trainer.generations`): `extras` is the reward function's per-sample outputs."""
        prompts = batch["prompts"]
        live = batch["attention_mask"][:, :prompts.shape[1]].bool()  # left padding off
        inputs = self.tokenizer.batch_decode([row[keep].tolist() for row, keep in zip(prompts, live)],
                                             skip_special_tokens=True)
        columns = {"uid": list(batch["uid"])}
        for key in dict.fromkeys(k for e in extras for k in e):
            if all(key in e for e in extras):
                columns[key] = [e[key] for e in extras]
        return generation_rows(inputs, [str(t) for t in batch["response_text"]], list(batch["ground_truth"]), scores,
                               self.global_step, columns)

    # ------------------------------------------------------------------- asynchronous RL (async_training)
    def _take_batch(self, m: dict) -> Batch:
        """This step's scored batch: generated now (synchronous), or taken from the rollout producer, stale
        samples dropped, with the async/* metrics (`tiller.trainer.async_rollout`)."""
        if self.producer is None:
            return self._collect_batch(m, self.global_step)
        item, waited = self.producer.get(self.global_step)
        m.update(item.metrics)  # the producer's gen / reward / filter timings and reward metrics
        m["timing_s/wait_for_rollout"] = waited
        m["timing_s/wait_for_train"] = item.wait_s
        m["timing_s/rollout_busy"] = item.busy_s
        self._sampler_state = item.sampler_state
        at = self.cfg.async_training
        batch, metrics = staleness_filter(item.batch, item.version, self.global_step, at.staleness_threshold,
                                          at.trigger_parameter_sync_step)
        m.update(metrics)
        if getattr(self, "_regenerated", 0):
            m["async/regenerated_on_resume"] = float(self._regenerated)
            self._regenerated = 0
        return batch

    def _start_producer(self) -> None:
        at, tr = self.cfg.async_training, self.cfg.trainer
        cpu = tr.device == "cpu"
        # each side's torch threads: trainer.num_threads, else (CPU) the cores split between the two sides
        threads = tr.num_threads or (max(1, torch.get_num_threads() // 2) if cpu else torch.get_num_threads())
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
        if self.rollouter is not None:  # every rollout worker fetches the published weights from the object store
            def load(published):
                version, ref = published
                self.rollouter.execute("load_rollout_weights", ref, version)
        else:
            def load(state):
                self.actor.execute("load_producer_weights", state)
        self.producer = RolloutProducer(
            produce=self._produce, load_weights=load,
            first_step=self.global_step + 1, last_step=self.total_steps,
            staleness_threshold=at.staleness_threshold, trigger=at.trigger_parameter_sync_step,
            partial_rollout=at.partial_rollout, num_threads=threads)
        if at.share_idle_threads and cpu and self.rollouter is None:  # (one process: the two threads share cores)
            self._thread_sharing = ThreadSharing(self.producer, own=threads, lent=threads)
            self.actor.execute("set_thread_poll", self._thread_sharing)
            # one-thread sides: the updates run a lane on the producer's thread (three single-threaded workers
            # share the cores well; lanes of several OpenMP threads would stall at barriers when oversubscribed)
            for group in (self.actor, self.critic) if threads == 1 else ():
                if group is not None:
                    group.execute("set_lent_lanes", 1, threads)
        self._publish(trainer_version(self.global_step + 1, at.trigger_parameter_sync_step))
        self.producer.start()

    def _produce(self, step: int, weights_hook) -> tuple[Batch, dict, dict]:
        """The producer thread's work for `step`: the synchronous loop's gen + reward (+ filter) phases."""
        m: dict[str, float] = {}
        batch = self._collect_batch(m, step, {"engine": "producer", "weights_hook": weights_hook})
        return batch, m, self.sampler.state_dict()

    def _publish_weights(self) -> None:
        """async: after every trigger_parameter_sync_step steps, the actor's weights go to the producer."""
        trigger = self.cfg.async_training.trigger_parameter_sync_step
        if self.producer is not None and self.global_step % trigger == 0:
            self._publish(trainer_version(self.global_step + 1, trigger))

    def _publish(self, version: int) -> None:
        """The actor's weights to the producer as `version`: a snapshot in this process, or (rollout pool) a
        reference to rank 0's copy in Ray's object store, also put on the pool's board (partial rollouts)."""
        if self.rollouter is None:
            self.producer.publish(version, self.actor.execute("producer_weights"))
            return
        ref = self.actor.execute_ref("publish_rollout_weights")
        self.producer.publish(version, (version, ref))
        if self._board is not None:
            self._board.publish(version, ref)

    def _generation_group(self, prompts: Batch) -> tuple[object, Batch]:
        """The worker group that samples `prompts` and the prompts it gets: the actor's, or (asynchronous RL on Ray,
        the producer's prompts) the rollout pool's, told the version it holds (the producer's weights hook loads
        newer published weights first, or stops it) and seeded in the pool's chunks."""
        if self.rollouter is None or prompts.meta.get("engine") != "producer":
            return self.actor, prompts
        hook = prompts.meta.get("weights_hook")
        meta = {k: v for k, v in prompts.meta.items() if k not in ("engine", "weights_hook")}
        meta["policy_version"] = int(hook()) if hook is not None else 0
        meta["seed_chunks"] = self.pool_seed_chunks
        if self._board is not None:
            meta["weights_board"] = self._board
        return self.rollouter, Batch(fields=dict(prompts.fields), meta=meta)

    def _serve(self, hooks, asked, validated, saved) -> tuple:
        """A front end's requests (`tiller.trainer.hooks.Requests`) after a step: a validation / checkpoint of the
        step not made yet. Returns (validated, saved)."""
        if asked.evaluate and self.val_ds is not None and validated is None:
            validated = self.validate()
            self.tracker.log(validated, step=self.global_step)
            hooks.evaluated(self.global_step, validated)
        if saved is None and (asked.save or asked.stop):
            saved = self.save_checkpoint()
        return validated, saved

    def _sampler_state_now(self) -> dict:
        """The prompt sampler's state as of the current step (async: the producer has drawn ahead)."""
        return self._sampler_state if self._sampler_state is not None else self.sampler.state_dict()

    # --------------------------------------------------------------------------------- phases
    def _prompt_batch(self, items, sampling: dict, tag: str, step: int | None = None, extra_meta=None) -> Batch:
        fields = {
            "prompt_ids": [it.prompt_ids for it in items],
            "prompt_text": [it.prompt_text for it in items],
            "data_source": [it.data_source for it in items],
            "ground_truth": [it.ground_truth for it in items],
            "extra_info": [it.extra_info for it in items],
            "uid": [f"{tag}-{j}" for j in range(len(items))],
        }
        if self.agent or self.custom_loops:
            fields["raw_prompt"] = [it.raw_prompt for it in items]
        if self.teacher_keys and items and items[0].route is not None:  # (training prompts: several teachers)
            fields["teacher_route"] = [it.route for it in items]
        if any(it.agent_name is not None for it in items):  # verl's per-row agent loop
            fields["agent_name"] = [it.agent_name for it in items]
        if any(it.multi_modal_inputs is not None for it in items):  # image prompts: pixels ride on each sample
            fields["multi_modal_inputs"] = [it.multi_modal_inputs for it in items]
            fields["images"] = [it.images for it in items]
        meta = {"sampling": sampling, "prompt_width": self.prompt_width, "response_width": self.response_width,
                "temperature": self.cfg.actor_rollout_ref.rollout.temperature,
                "global_step": self.global_step if step is None else step, "seed_chunks": self.rollout_seed_chunks,
                **(extra_meta or {})}
        return Batch(fields=fields, meta=meta)

    def response_limit(self, step: int) -> int:
        """Step `step`'s response-length limit: Skywork-OR1's multi-stage length (`rollout.response_length_schedule`,
        the last stage whose from_step <= step), else the response width. A function of the step alone, so a run
        resumed at any step, in any stage, samples with that stage's limit."""
        length = self.response_width
        for start, max_len in self.cfg.actor_rollout_ref.rollout.response_length_schedule:
            if step >= start:
                length = min(max_len, self.response_width)  # (validation refuses a longer stage)
        return length

    def _train_sampling(self, step: int) -> dict:
        r = self.cfg.actor_rollout_ref.rollout
        return dict(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                    max_new_tokens=self.response_limit(step), do_sample=r.do_sample, stop=tuple(r.stop),
                    ignore_eos=r.ignore_eos, seed=self.cfg.trainer.seed * 1_000_003 + step, **shaping_of(r))

    def _next_prompts(self, round_: int, step: int, extra_meta=None) -> Batch:
        """Step `step`'s next data.gen_batch_size prompts (= train_batch_size unless DAPO's dynamic sampling)."""
        items = [self.train_ds[i] for i in self.sampler.next_batch()]
        tag = f"s{step}" if round_ == 1 else f"s{step}r{round_}"
        sampling = self._train_sampling(step)
        if round_ > 1:  # each round its own samples
            sampling["seed"] = sampling["seed"] + 7_919_993 * (round_ - 1)
        return self._prompt_batch(items, sampling, tag=tag, step=step, extra_meta=extra_meta)

    def _generate(self, prompts: Batch) -> Batch:
        """The actor group's samples of `prompts` (prompt chunks over the ranks, dispatch dp). Agent rollouts: each
        rank runs its chunk's episodes and the driver merges the ranks' segment batches (episode ids offset, widths
        padded: `tiller.trainer.episode_merge`), so everything after sees one batch, as with one process."""
        group, prompts = self._generation_group(prompts)
        if not self.agent:
            return group.execute("generate_sequences", prompts, dispatch="dp")
        parts = group.execute("generate_sequences", prompts, dispatch="dp_parts")
        return merge_episode_parts(parts, len(prompts), int(prompts.meta["sampling"]["n"]),
                                   self.tokenizer.pad_token_id)

    def _generate_scored(self, round_: int, m: dict, step: int, extra_meta=None) -> Batch:
        """One generation round: prompts -> n samples each (+ ReMax's greedy baseline) -> reward."""
        prompts = self._next_prompts(round_, step, extra_meta)
        with timer("gen", m):
            batch, source = self.rollout_skip.generate(step, round_, lambda: self._generate(prompts))
        if source is not None:
            m["skip/rollout_loaded_from_step"] = float(source)
        if self.cfg.algorithm.adv_estimator == "remax":
            with timer("gen_max", m):
                batch["reward_baselines"] = self._greedy_baseline(prompts)
        with timer("reward", m):
            self._compute_reward(batch, m)
        return batch

    def _collect_batch(self, m: dict, step: int, extra_meta=None) -> Batch:
        """The step's batch. With algorithm.filter_groups (DAPO dynamic sampling, Yu et al. 2025, arXiv
        2503.14476): generation rounds of data.gen_batch_size prompts, each filtered to the groups whose
        metric varies, until data.train_batch_size groups are collected (then exactly that many are kept)
        or max_num_gen_batches rounds ran (0 = no cap; at the cap the step trains on what was collected,
        where verl raises). Metrics: batch/num_gen_batches, batch/num_groups, batch/num_groups_kept."""
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            return self._generate_scored(1, m, step, extra_meta)
        want, kept, n_kept, n_seen, rounds, episodes = self.cfg.data.train_batch_size, [], 0, 0, 0, 0
        while n_kept < want and (fg.max_num_gen_batches <= 0 or rounds < fg.max_num_gen_batches):
            rounds += 1
            batch = self._generate_scored(rounds, m, step, extra_meta)
            if "episode" in batch and len(batch):  # agent rollouts: episode ids stay unique across rounds
                batch["episode"] = batch["episode"] + episodes
                episodes = int(batch["episode"].max()) + 1
            if fg.metric == "seq_final_reward" and self.cfg.algorithm.use_kl_in_reward:
                batch = self._kl_inputs(batch, m)  # the filter needs the KL-penalised rewards (as verl)
            with timer("filter_groups", m):
                n_seen += len(set(batch["uid"]))
                batch = self._filter_groups(batch)
            n_kept += len(set(batch["uid"]))
            kept.append(batch)
        if len(kept) == 1:
            batch = kept[0]
        elif "episode" in kept[0]:  # agent rounds: each round's widths are its longest context / segment
            batch = concat_episode_batches(kept, self.tokenizer.pad_token_id)
        else:
            batch = Batch.concat(kept)
        if n_kept > want:  # keep the first train_batch_size groups (agent rollouts: all their segments)
            first = set(list(dict.fromkeys(batch["uid"]))[:want])
            batch = batch.index(np.array([u in first for u in batch["uid"]]))
        elif n_kept < want and rounds > 1:  # (a cap of one round asks for "train on what passes")
            print(f"tiller: step {step}: {n_kept} of {want} groups passed "
                  f"algorithm.filter_groups after {rounds} generation rounds (max_num_gen_batches); "
                  "training on those")
        if "episode" in batch and len(batch):  # filtered out episodes leave gaps: ids 0..k-1 again, in order
            batch["episode"] = renumber_episodes(batch["episode"])
        m["batch/num_gen_batches"] = float(rounds)
        m["batch/num_groups"] = float(n_seen)
        m["batch/num_groups_kept"] = float(len(set(batch["uid"])))
        return batch

    def _kl_inputs(self, batch: Batch, m: dict) -> Batch:
        """Old and reference logprobs of a generation round (KL in reward, before filtering)."""
        if self.bypass:
            batch["old_log_probs"] = batch["rollout_log_probs"]
        else:
            with timer("old_log_prob", m):
                batch = batch.union(self.actor.execute("compute_log_prob", batch, **self.actor_dp_call))
        with timer("ref", m):
            batch = batch.union(self.actor.execute("compute_ref_log_prob", batch, **self.actor_dp_call))
        return batch

    def _balance_batch(self, batch: Batch, m: dict) -> Batch:
        """trainer.balance_batch: reorder rows so each data-parallel worker's contiguous share holds an
        equal number of tokens (verl's `_balance_batch`, metrics `global_seqlen/*`); whole groups move
        together when the groups split evenly over the workers (`tiller.data.seqlen.balanced_order`)."""
        if len(batch) % self.world_size:
            return batch
        order, metrics = balanced_order(batch["attention_mask"].sum(-1).tolist(), list(batch["uid"]), self.world_size)
        m.update(metrics)
        return batch.index(order)

    def _greedy_baseline(self, prompts: Batch) -> torch.Tensor:
        """ReMax's b(x): the score of the greedy response to each prompt, repeated n times -> [B]."""
        greedy = Batch(fields=dict(prompts.fields), meta=dict(prompts.meta))
        greedy.meta["sampling"] = {**prompts.meta["sampling"], "n": 1, "do_sample": False}
        group, greedy = self._generation_group(greedy)
        out = group.execute("generate_sequences", greedy, dispatch="dp")
        scores, _, _ = self._score(out)
        return torch.as_tensor(scores, dtype=torch.float32).repeat_interleave(self.n)

    def _score(self, batch: Batch) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Decode responses and call the reward manager: (scores[B], extras, metrics). Agent rollouts: the
        episode's reward (from the agent or environment) on each of its rows."""
        lengths = batch["response_mask"].sum(-1).tolist()
        multi_turn = "tool_rewards" in batch
        if multi_turn:  # (verl: the valid response ids, tool results included: the response's attended tokens)
            lengths = batch["attention_mask"][:, batch["prompts"].shape[1]:].sum(-1).tolist()
        responses = batch["responses"]
        texts = self.tokenizer.batch_decode([responses[i, :n].tolist() for i, n in enumerate(lengths)],
                                            skip_special_tokens=True)
        if "agent_reward" in batch:
            batch["response_text"] = texts
            scores = batch["agent_reward"].numpy().astype(np.float32)
            episodes = batch["episode"]
            n_episodes = int(episodes.max()) + 1 if len(batch) else 0
            per_episode = torch.zeros(max(1, n_episodes)).index_put_((episodes,), batch["agent_reward"])
            extras = {"acc": batch["agent_acc"].numpy()} if "agent_acc" in batch else {}  # OpenRLHF's scores
            return scores, extras, {"agent/segments_per_episode/mean": len(batch) / max(1, n_episodes),
                                "agent/reward/mean": float(per_episode[:n_episodes].mean()) if n_episodes else 0.0,
                                "agent/episodes_without_segment": float((batch["response_mask"].sum(-1) == 0).sum())}
        prompts = batch["prompts"]
        prompt_attn = batch["attention_mask"][:, :prompts.shape[1]].bool()
        requests = [
            RewardRequest(data_source=str(batch["data_source"][i]), prompt=str(batch["prompt_text"][i]),
                          response=texts[i], ground_truth=batch["ground_truth"][i],
                          extra_info=_extra_info(batch, i), response_length=int(lengths[i]),
                          group=str(batch["uid"][i]), response_ids=responses[i, :lengths[i]].tolist(),
                          prompt_ids=prompts[i][prompt_attn[i]].tolist(),
                          messages=batch["completion_messages"][i] if "completion_messages" in batch else None,
                          state=batch["agent_state"][i] if "agent_state" in batch else None)
            for i in range(len(batch))
        ]
        result = self.reward_fn(requests)
        scores = np.asarray(result.scores, dtype=np.float32)
        metrics = dict(result.metrics)
        given = [getattr(s, "reward_score", None) for s in batch["agent_state"]] if "agent_state" in batch else []
        if any(g is not None for g in given):  # verl agent loops that score their own trajectories (reward_score)
            for i, g in enumerate(given):
                if g is not None:
                    scores[i] = float(g)
            metrics["agent/reward_score_given"] = float(sum(g is not None for g in given))
        if self.count_bad_ground_truth:  # reward_model.bad_ground_truth=count: such samples score 0, counted
            bad = np.array([ground_truth_problem(r.data_source, r.ground_truth) is not None for r in requests], bool)
            scores[bad] = 0.0
            metrics["reward/bad_ground_truth"] = float(bad.sum())
            self.bad_ground_truth_total += int(bad.sum())
        if multi_turn:  # tiller eval's `agent` means, per sample
            metrics.update(tool_metrics(*(batch[k] for k in TOOL_FIELDS)))
        batch["response_text"] = texts
        return scores, dict(result.extras), metrics

    def _compute_reward(self, batch: Batch, m: dict) -> None:
        """`token_level_scores[B, T]`: the scalar reward on each response's last token (0 elsewhere)."""
        scores, extras, metrics = self._score(batch)
        mask = batch["response_mask"]
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        # the last trained token (multi-turn rows: tool-response tokens are out of the mask, possibly last)
        last = (mask.shape[1] - 1 - mask.flip(-1).argmax(-1)) * (mask.sum(-1) > 0)
        token_scores[torch.arange(len(batch)), last] = torch.from_numpy(scores) * (mask.sum(-1) > 0).float()
        batch["token_level_scores"] = token_scores
        batch["score"] = torch.from_numpy(scores)
        batch["acc"] = torch.as_tensor(np.asarray(extras.get("acc", scores), dtype=np.float32))
        if self.cfg.trainer.rollout_data_dir:  # the step's dump writes them (rows may be filtered or joined first)
            batch["reward_extras"] = per_sample_extras(extras, len(batch))
        for k, v in extras.items():
            arr = np.asarray(v)
            if arr.dtype.kind in "fiub" and arr.shape == (len(batch),):
                m[f"reward_extra/{k}/mean"] = float(arr.astype(np.float64).mean())
        nan_ok = self.cfg.algorithm.gdpo_normalization == "sequence"  # TRL's None scores: NaN, skipped
        for k in self.cfg.algorithm.gdpo_reward_keys:  # gdpo's reward channels travel with their rows
            batch[f"reward_channel/{k}"] = self._reward_channel(extras, k, len(batch), nan_ok)
        m.update(metrics)

    @staticmethod
    def _reward_channel(extras: dict, key: str, n: int, nan_ok: bool = False) -> torch.Tensor:
        """One named score of every sample (algorithm.gdpo_reward_keys): DataError if a sample lacks it (unless
        `nan_ok` and the key is there: TRL's None scores)."""
        values = np.asarray(extras.get(key, np.full(n, np.nan)), dtype=np.float64)
        if values.shape != (n,) or key not in extras or (np.isnan(values).any() and not nan_ok):
            raise DataError(f"algorithm.gdpo_reward_keys: {key!r} is missing from the reward of "
                            f"{int(np.isnan(values).sum()) if values.shape == (n,) else n} of {n} samples; the "
                            f"reward function must return a dict with {key!r} for every sample (named scores "
                            f"returned: {sorted(extras)})")
        return torch.as_tensor(values, dtype=torch.float32)

    def _compute_advantage(self, batch: Batch, m: dict, baseline: torch.Tensor | None) -> None:
        """KL in reward (optional) then the registered estimator: `advantages`, `returns` [B, T]."""
        algo = self.cfg.algorithm
        mask = batch["response_mask"]
        rewards = batch["token_level_scores"]
        coef = self.cfg.reward_model.stop_properly_penalty_coef
        if coef is not None:  # OpenRLHF's ProRL truncation penalty, before KL shaping and the estimator
            rewards = self._stop_properly_penalty(batch, rewards, float(coef), m)
        if algo.use_kl_in_reward:
            rewards, km = apply_kl_in_reward(rewards, batch["old_log_probs"], batch["ref_log_prob"], mask,
                                             self.kl_ctrl.value, kind=algo.kl_penalty)
            m["actor/reward_kl_penalty"] = float(km["kl"])
            m["actor/reward_kl_penalty_coeff"] = float(self.kl_ctrl.value)
            self.kl_ctrl.update(float(km["kl"]), n_steps=len(batch))  # verl: samples in the batch
        batch["token_level_rewards"] = rewards
        if self.rollout_correction:  # verl's order: after KL in reward, before the estimator
            mask = self._rollout_correction(batch, m)
        hyper = dict(gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)
        if algo.adv_estimator in ("grpo", "grpo_passk", "gdpo"):
            hyper["epsilon"] = algo.norm_adv_epsilon
        if algo.adv_estimator == "grpo":
            hyper["std_scope"] = algo.norm_adv_std_scope
        if baseline is not None:
            hyper["baseline_rewards"] = baseline
        if algo.adv_estimator == "gdpo":
            hyper.update(gdpo_reward_keys=list(algo.gdpo_reward_keys), gdpo_reward_weights=algo.gdpo_reward_weights,
                         gdpo_normalization=algo.gdpo_normalization,
                         reward_components={k: batch[f"reward_channel/{k}"] for k in algo.gdpo_reward_keys})
        if algo.adv_estimator == "prime":
            hyper.update(self._prime_hyper(batch, mask, m))
        if self.need_sum_pi2:
            hyper.update(old_logp=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"],
                         rollout_is_weights=batch["rollout_is_weights"] if "rollout_is_weights" in batch else None)
        values = batch["values"] if "values" in batch else None
        if "episode" in batch:  # agent rollouts: one advantage per episode, given to each of its segments
            adv, ret = self._episode_advantage(batch, mask, hyper)
        else:
            adv, ret = get_advantage_estimator(algo.adv_estimator)(rewards, mask, list(batch["uid"]), values, **hyper)
        batch["advantages"], batch["returns"] = adv.float(), ret.float()

    def _pf_ppo_resample(self, batch: Batch, m: dict) -> Batch:
        """algorithm.use_pf_ppo (verl, GAE only): the batch redrawn with replacement by its sequence scores'
        weights (`tiller.algos.pf_ppo`); seeded by the run's seed and the step, so a resumed run redraws alike."""
        pf = self.cfg.algorithm.pf_ppo
        gen = torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + self.global_step + 91_919)
        idx = pf_ppo_resample(batch["token_level_scores"].sum(-1), pf.get("reweight_method", "pow"),
                              float(pf.get("weight_pow", 2.0)), generator=gen)
        m["pf_ppo/unique_samples"] = float(len(set(idx.tolist())))
        return batch.index(idx)

    def _prime_hyper(self, batch: Batch, mask: torch.Tensor, m: dict) -> dict:
        """PRIME's estimator inputs: the dense implicit rewards from the PRM's log-ratio, and the coefficients."""
        p = self.cfg.algorithm.prime
        dense = prime_token_rewards(batch["prm_q"], mask, p.beta_train, p.granularity, p.norm)
        m["prime/dense_reward/mean"] = float((dense * mask).sum(-1).mean())
        m["prime/raw_implicit_reward/mean"] = float(p.beta_train * (batch["prm_q"] * mask).sum(-1).mean())
        return dict(prime_token_rewards=dense, reward_gt_coef=p.reward_gt_coef, reward_dpo_coef=p.reward_dpo_coef)

    def _prm_batch(self, batch: Batch) -> Batch:
        """What the PRM update needs (the outcome labels `acc` with the token tensors), padded to the world size."""
        acc = batch["acc"]
        if len(acc) and (float(acc.min()) < 0.0 or float(acc.max()) > 1.0):
            raise DataError(f"algorithm.adv_estimator=prime: the PRM learns outcome labels in [0, 1] (the reward's "
                            f"`acc`, else its score), got values in [{float(acc.min()):g}, {float(acc.max()):g}]; "
                            "return acc in the reward function's dict")
        out = batch.select(["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask",
                            "acc"])
        prompts = self.cfg.algorithm.prime.mini_batch_size or self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        out.meta = {"prm_mini_batch_size": prompts * self.n // self.actor_dp}
        return self._pad_to_world(out)

    def _refuse_text_models_for_images(self, cfg) -> None:
        """Image prompts: every model that reads them must take the pixels (a text model would read the image
        placeholders as text); PRIME's implicit PRM update is not wired for pixels."""
        ds = [d for d in (self.train_ds, self.val_ds) if d is not None]
        if not any(it.multi_modal_inputs is not None for d in ds for it in d.items):
            return
        algo = cfg.algorithm
        if algo.adv_estimator == "prime":
            raise ConfigError("algorithm.adv_estimator=prime: the prompts have images and PRIME's implicit PRM update "
                              "takes text only in this version; use grpo / rloo / gae ...")
        # several teachers: only those scoring image rows must read pixels (verl's MOPD pairs a text teacher for
        # text rows with a vision-language one for image rows)
        image_routes = {it.route for it in self.train_ds.items if it.multi_modal_inputs is not None}
        paths = {"algorithm.distill.teacher_path": algo.distill.teacher_path,
                 **{f"algorithm.distill.teachers[{k!r}]": p for k, p in algo.distill.teachers.items()
                    if k in image_routes}}
        if self.use_critic:
            paths["critic.model.path"] = cfg.critic.model.path or cfg.actor_rollout_ref.model.path
        for key, path in paths.items():
            if path and not is_vision_checkpoint(path):
                raise ConfigError(f"{key}={path}: the prompts have images but this is a text-only model (it would "
                                  "ignore the pixels); use a vision-language model (default: the actor's)")

    def _teacher_index(self, batch: Batch) -> torch.Tensor:
        """teacher_index[B] (long): each sample's teacher, its position in sorted(algorithm.distill.teachers)."""
        if "teacher_route" not in batch:  # (every rollout path carries its prompts' fields; a guard, not a case)
            raise RuntimeError("algorithm.distill.teachers: the step's samples carry no teacher_route field")
        return torch.tensor([self.teacher_keys.index(r) for r in batch["teacher_route"]], dtype=torch.long)

    def _pad_to_world(self, out: Batch) -> Batch:
        """Rows appended (copies with a zero response mask) so the batch divides over the workers."""
        pad = (-len(out)) % self.world_size
        if pad and len(out):
            extra = out.index(list(range(pad)))
            extra["response_mask"] = torch.zeros_like(extra["response_mask"])
            if "seq_counted" in extra:
                extra["seq_counted"] = torch.zeros_like(extra["seq_counted"])
            out = Batch.concat([out, extra])
        return out

    def _episode_advantage(self, batch: Batch, mask: torch.Tensor, hyper: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimator on one row per episode (its reward, a one-token response), broadcast to the episode's
        segments: every episode counts once in its group's baseline, whatever its number of requests."""
        episodes = batch["episode"]
        n = int(episodes.max()) + 1
        first = torch.full((n,), -1, dtype=torch.long)
        for row in range(len(batch) - 1, -1, -1):
            first[episodes[row]] = row
        reward = batch["agent_reward"][first][:, None]
        uids = [batch["uid"][int(r)] for r in first]
        adv_ep, ret_ep = get_advantage_estimator(self.cfg.algorithm.adv_estimator)(
            reward, torch.ones_like(reward), uids, None, **hyper)
        adv = adv_ep[episodes, 0][:, None] * mask
        ret = ret_ep[episodes, 0][:, None] * mask
        return adv, ret

    def _rollout_correction(self, batch: Batch, m: dict) -> torch.Tensor:
        """TIS weights (`rollout_is_weights[B, T]`, when rollout_is is set) and the rejection mask (`loss_mask[B, T]`,
        the response mask with rejected tokens 0) from old vs rollout logprobs; `rollout_corr/*` metrics.
        Returns the loss mask (what the estimator and the updates use; data metrics keep `response_mask`)."""
        rc = self.cfg.algorithm.rollout_correction
        weights, loss_mask, metrics = rollout_correction(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], rollout_is=rc.rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold, rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
            rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold)
        if rc.rollout_is is not None:
            batch["rollout_is_weights"] = weights
        batch["loss_mask"] = loss_mask
        m.update({f"rollout_corr/{k}": float(v) for k, v in metrics.items()})
        return loss_mask

    def _mismatch_metrics(self, batch: Batch) -> dict[str, float]:
        """`training/rollout_probs_diff_*` and `training/rollout_actor_probs_pearson_corr` (old vs rollout)."""
        metrics = rollout_mismatch_metrics(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
        return {f"training/{k}": float(v) for k, v in metrics.items()}

    def _filter_groups(self, batch: Batch) -> Batch:
        """DAPO dynamic sampling: keep the groups whose metric is not the same for all n samples (and, as
        verl, groups of one sample). Metrics as verl's: acc, score, seq_reward = sum of
        token_level_scores, seq_final_reward = sum of token_level_rewards (after KL in reward)."""
        algo = self.cfg.algorithm
        metric = algo.filter_groups.metric
        if metric in ("acc", "score"):
            values = batch[metric]
        elif metric == "seq_final_reward" and algo.use_kl_in_reward:
            values = apply_kl_in_reward(batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                                        batch["response_mask"], self.kl_ctrl.value, kind=algo.kl_penalty)[0].sum(-1)
        else:
            values = batch["token_level_scores"].sum(-1)
        by_group: dict[str, list[float]] = defaultdict(list)
        for uid, v in zip(batch["uid"], values.tolist()):
            by_group[uid].append(v)
        keep_groups = {u for u, vs in by_group.items() if max(vs) - min(vs) > 1e-8 or len(vs) == 1}
        keep = np.array([u in keep_groups for u in batch["uid"]])
        return batch.index(keep)

    @staticmethod
    def _stop_properly_penalty(batch: Batch, rewards: torch.Tensor, coef: float, m: dict) -> torch.Tensor:
        """reward_model.stop_properly_penalty_coef: a truncated row's token rewards scaled by coef (>= 0) or its
        reward set to coef on its last response token (< 0), as OpenRLHF's apply_stop_properly_penalty."""
        if "finish_reason" not in batch:
            raise ConfigError("reward_model.stop_properly_penalty_coef: this rollout gives no finish reasons")
        cut = torch.tensor([r == "length" for r in batch["finish_reason"]], dtype=torch.bool)
        m["reward/stop_properly_penalized_frac"] = float(cut.float().mean()) if len(cut) else 0.0
        if not bool(cut.any()):
            return rewards
        if coef >= 0:
            return torch.where(cut[:, None], rewards * coef, rewards)
        mask = batch["response_mask"]
        last = (mask.shape[1] - 1 - mask.flip(-1).argmax(-1))
        fixed = torch.zeros_like(rewards)
        fixed[torch.arange(len(rewards)), last] = coef
        return torch.where(cut[:, None], fixed, rewards)

    def _mask_truncated(self, batch: Batch, m: dict) -> None:
        """actor.mask_truncated_responses: a truncated response's tokens leave the loss mask (`loss_mask`, which the
        updates use in place of response_mask; the row still counts as a sequence)."""
        if "finish_reason" not in batch:
            raise ConfigError("actor_rollout_ref.actor.mask_truncated_responses=true: this rollout gives no "
                              "finish reasons (agent rollouts)")
        keep = torch.tensor([r != "length" for r in batch["finish_reason"]], dtype=batch["response_mask"].dtype)
        base = batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]
        batch["loss_mask"] = base * keep[:, None]
        m["actor/masked_truncated_frac"] = float(1.0 - keep.float().mean()) if len(keep) else 0.0

    def _for_update(self, batch: Batch) -> Batch:
        """Keys the updates need, padded to a multiple of the world size with masked-out rows."""
        keys = ["input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask",
                "advantages", "returns"]
        keys += [k for k in ("old_log_probs", "ref_log_prob", "teacher_log_prob", "teacher_index", "values",
                             "rollout_is_weights", "routed_experts",  # (MoE routing replay: the routing to use)
                             "multi_modal_inputs")  # image prompts: the updates' forwards take the pixels too
                 if k in batch]
        if "old_log_probs" not in batch or self._mismatch_in_update:  # the actor measures it in its update
            keys.append("rollout_log_probs")
        out = batch.select(keys)
        if "loss_mask" in batch:  # rollout correction's rejections: the updates skip those tokens
            out["response_mask"] = batch["loss_mask"]
            out["seq_counted"] = batch["response_mask"].sum(-1) > 0  # a row rejected whole still counts (verl)
        a = self.cfg.actor_rollout_ref.actor
        coeff = a.entropy_coeff
        if self.entropy_ctrl is not None:
            coeff = self.entropy_ctrl.effective_coeff(self._last_entropy)
        ppo_epochs = self.cfg.critic.ppo_epochs or a.ppo_epochs
        critic_mini = (self.cfg.critic.ppo_mini_batch_size or a.ppo_mini_batch_size) * self.n // self.critic_dp
        mini = a.ppo_mini_batch_size * self.n // self.actor_dp
        if self.agent:  # rows are segments: as many mini-batches as configured, of equal row counts
            parts = self.cfg.data.train_batch_size // a.ppo_mini_batch_size
            rows = -(-len(out) // self.actor_dp)  # a rank's share (the batch is padded to the world size below)
            mini = max(1, -(-rows // parts))
        out.meta = {"mini_batch_size": mini,
                    "critic_mini_batch_size": critic_mini, "ppo_epochs": ppo_epochs,
                    "temperature": self.cfg.actor_rollout_ref.rollout.temperature,
                    "global_step": self.global_step, "entropy_coeff": coeff,
                    "measure_mismatch": "old_log_probs" not in batch or self._mismatch_in_update}
        return self._pad_to_world(out)

    def _update_entropy_ctrl(self, m: dict) -> None:
        if self.entropy_ctrl is not None:  # the coefficient this step's update applied
            m["actor/entropy_coeff"] = self.entropy_ctrl.effective_coeff(self._last_entropy)
        if "actor/entropy" in m:
            self._last_entropy = m["actor/entropy"]
        if self.entropy_ctrl is not None:
            m["actor/adaptive_entropy_coeff"] = self.entropy_ctrl.update(self._last_entropy)  # the next step's

    # -------------------------------------------------------------------------------- metrics
    def _data_metrics(self, batch: Batch, m: dict) -> dict[str, float]:
        if not len(batch):  # no group passed algorithm.filter_groups
            return {}
        limit = self.response_limit(self.global_step)
        out = data_metrics(batch, limit)  # clip_ratio: responses that reached this step's limit
        out["response_length/limit"] = float(limit)
        if self.use_critic and "values" in batch:
            out.update(value_metrics(batch["values"], batch["returns"], batch["response_mask"]))
        step_s = m.get("timing_s/step", 0.0)
        tokens = float(batch["attention_mask"].sum())
        out["perf/total_num_tokens"] = tokens
        out["perf/throughput"] = tokens / step_s / self.world_size if step_s > 0 else 0.0
        mfu = self._actor_mfu(batch, m.get("timing_s/update_actor", 0.0))
        if mfu is not None:  # CUDA devices in verl's table only (tiller.trainer.flops)
            out["perf/mfu/actor"] = mfu
        if self.cfg.actor_rollout_ref.rollout.moe_load_balance_metrics_interval and "routed_experts" in batch:
            out.update(self._moe_load_metrics(batch))
        return out

    def _moe_load_metrics(self, batch: Batch) -> dict[str, float]:
        """verl's `rollout/moe/*` load-balance metrics: this step's response tokens' experts (the recorded routing)
        added to the counts since the last log; logged, and the counts reset, every
        rollout.moe_load_balance_metrics_interval steps."""
        if not hasattr(self, "_num_experts"):
            m = self.cfg.actor_rollout_ref.model
            self._num_experts = routing.num_experts(
                model_config(m.path, m.override_config, trust_remote_code=m.trust_remote_code))
        counts = moe_expert_counts(batch["routed_experts"], batch["response_mask"], self._num_experts)
        self._moe_counts = counts if self._moe_counts is None else self._moe_counts + counts
        if self.global_step % self.cfg.actor_rollout_ref.rollout.moe_load_balance_metrics_interval:
            return {}
        counts, self._moe_counts = self._moe_counts, None
        return moe_load_balance_metrics(counts)

    def _actor_mfu(self, batch: Batch, seconds: float) -> float | None:
        """verl's perf/mfu/actor for this step's update (None off CUDA or on a device verl's table does not name)."""
        if not hasattr(self, "_mfu_model"):
            self._mfu_model, self._mfu_peak = None, None
            if self.cfg.trainer.device == "cuda" and torch.cuda.is_available():
                m = self.cfg.actor_rollout_ref.model
                self._mfu_peak = device_peak_flops(torch.cuda.get_device_name())
                self._mfu_model = model_config(m.path, m.override_config, trust_remote_code=m.trust_remote_code)
        if self._mfu_model is None:
            return None
        seqlens = batch["attention_mask"].sum(-1).tolist()
        return actor_mfu(self._mfu_model, seqlens, seconds, self._mfu_peak,
                         self.cfg.actor_rollout_ref.actor.ppo_epochs, self.world_size)

    def validate(self) -> dict[str, float]:
        """Generate for the validation set with `rollout.val_kwargs`; `val-core/<source>/acc/mean@N` etc."""
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        sampling = dict(n=vk.n, temperature=vk.temperature if vk.do_sample else 1.0, top_p=vk.top_p, top_k=vk.top_k,
                        max_new_tokens=self.response_width, do_sample=vk.do_sample,
                        stop=tuple(self.cfg.actor_rollout_ref.rollout.stop), seed=self.cfg.trainer.seed + 424_242,
                        **shaping_of(self.cfg.actor_rollout_ref.rollout))
        size = self.cfg.data.val_batch_size or len(self.val_ds)
        rows, dumped, tools = [], [], {k: [] for k in TOOL_FIELDS}
        for start in range(0, len(self.val_ds), size):
            items = self.val_ds.items[start:start + size]
            prompts = self._prompt_batch(items, sampling, tag=f"v{start}")
            out = self._generate(prompts)
            if "episode" in out:  # agent rollouts: one row per episode (its last segment)
                last = {int(e): i for i, e in enumerate(out["episode"].tolist())}
                out = out.index(sorted(last.values()))
            scores, extras, _ = self._score(out)
            for k in tools if "tool_rewards" in out else ():  # multi-turn tool rollouts
                tools[k] += list(out[k])
            if self.cfg.trainer.validation_data_dir:
                dumped += self._dump_rows(out, scores.tolist(), per_sample_extras(extras, len(out)))
            accs = np.asarray(extras.get("acc", scores), dtype=np.float64)
            preds = extras.get("pred", out["response_text"])
            for i in range(len(out)):
                rows.append((str(out["data_source"][i]), str(out["uid"][i]), float(scores[i]), float(accs[i]),
                             str(preds[i]), str(out["prompt_text"][i]), str(out["response_text"][i])))
        n_log = self.cfg.trainer.log_val_generations
        for ds, _, score, _, _, prompt, response in rows[:n_log]:
            print(f"[val {ds}] score={score:g} | {prompt!r} -> {response!r}")
        if self.cfg.trainer.validation_data_dir:
            dump_generations(self.cfg.trainer.validation_data_dir, self.global_step, dumped)
        metrics = validation_metrics(rows, vk.n)
        if tools["tool_rewards"]:
            metrics.update(tool_metrics(*tools.values(), prefix="val-agent"))
        self.val_history.append((self.global_step, metrics))
        return metrics

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> Path:
        """Critic first (its own dir), then the actor with the driver's state (its marker marks the step)."""
        keep = self.cfg.trainer.max_actor_ckpt_to_keep
        if self.critic is not None:
            self.critic.execute("save_checkpoint", str(self.ckpt_root / CRITIC_SUBDIR), self.global_step,
                                keep + 1 if keep else None)
        extra = {"sampler": self._sampler_state_now(), "sampling": sampling_settings(self.cfg),
                 "kl_coef": float(self.kl_ctrl.value),
                 "entropy_coeff": None if self.entropy_ctrl is None else self.entropy_ctrl.value,
                 "last_entropy": self._last_entropy}
        if self.producer is not None:  # generated ahead, lost with the process: a resume regenerates them
            extra["async_in_flight"] = self.producer.in_flight(self.global_step)
        return Path(self.actor.execute("save_checkpoint", str(self.ckpt_root), self.global_step, extra, keep))

    def _claim_run_dir(self) -> None:
        """Refuse an earlier run's records this run would not continue, or (trainer.overwrite=true) note them to
        clear at the end of start-up (`tiller.trainer.rundir.claim_run_dir`): a checkpoint of another model is a
        mismatch, refused by name."""
        self._replaced_records = claim_run_dir(self.run_dir, self.ckpt_root, self.cfg.trainer,
                                               self.cfg.actor_rollout_ref.model.path)

    def _load_newest_good_checkpoint(self) -> tuple[Path | None, dict | None]:
        """resume_mode=auto: the newest checkpoint that loads; a damaged one (truncated weights, optimizer or state
        file) is skipped with a warning naming it and the cause, and the next older one is tried."""
        for path in reversed(list_checkpoints(self.ckpt_root)):
            try:
                return path, self.actor.execute("load_checkpoint", str(path))
            except Exception as err:  # noqa: BLE001 - any failure to read it: damaged, try the one before
                print(f"warning: checkpoint {path} does not load ({type(err).__name__}: {str(err)[:200]}); "
                      "resuming from the one before it")
        return None, None

    def _maybe_resume(self) -> None:
        tr = self.cfg.trainer
        if tr.resume_mode == "disable":
            return
        if tr.resume_mode == "resume_path":
            path = resolve_checkpoint(tr.resume_from_path)
            state = self.actor.execute("load_checkpoint", str(path))
        else:
            path, state = self._load_newest_good_checkpoint()
            if path is None:
                records = run_records(self.run_dir, self.ckpt_root)
                if records and list_checkpoints(self.ckpt_root) and not tr.overwrite:
                    raise ConfigError(f"trainer.default_local_dir={self.run_dir}: none of its checkpoints loads (each "
                                      "named above) and its records were left as they are: pass "
                                      "trainer.overwrite=true to start over in it, or choose another "
                                      "trainer.default_local_dir")
                if records:
                    clear_records(self.run_dir, records)
                return
        self.global_step = int(state["step"])
        changed = sampling_changes(state.get("sampling"), sampling_settings(self.cfg))
        if changed:
            print(f"resuming {Path(path).name} with sampling changed since that checkpoint: {changed}", file=sys.stderr)
        if self.critic is not None:
            self.critic.execute("load_checkpoint", str(Path(path).parent / CRITIC_SUBDIR / Path(path).name))
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.value = float(state.get("kl_coef", self.kl_ctrl.value))
        if self.entropy_ctrl is not None and state.get("entropy_coeff") is not None:
            self.entropy_ctrl.value = float(state["entropy_coeff"])
        self._last_entropy = float(state.get("last_entropy", float("inf")))
        self._regenerated = int(state.get("async_in_flight", 0))
        print(f"resumed from {path} (step {self.global_step})"
              + (f"; {self._regenerated} step batches generated ahead of it are generated again"
                 if self._regenerated else ""))

    def shutdown(self) -> None:
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        release_run_dir(self.run_dir)
        for group in (self.actor, getattr(self, "rollouter", None)):
            try:
                if group is not None:
                    group.execute("close_rollout", dispatch="all")  # stops vLLM's engine processes now
            except WorkerError:  # a dead worker group has nothing left to close
                pass
        for group in (self.actor, self.critic, getattr(self, "rollouter", None)):
            if group is not None:
                group.shutdown()
        if getattr(self, "_board", None) is not None:
            self._board.close()


def run(cfg: RLConfig, reward_fn=None, tool_loop=None) -> dict[str, float]:
    """Train with `cfg`; returns the last step's metrics (workers shut down after). `reward_fn`: an in-process
    scorer (`score(list[RewardRequest]) -> ScoreBatch`) in place of the config's reward manager; `tool_loop`: an
    in-process multi-turn loop (`tiller.trl.tool_loop.TRLToolLoop`) in place of multi_turn's."""
    start = time.time()
    trainer = RLTrainer(cfg, reward_fn=reward_fn, tool_loop=tool_loop)
    try:
        metrics = trainer.fit()
    finally:
        trainer.shutdown()
    metrics = dict(metrics)
    metrics["wall_s"] = time.time() - start
    return metrics


def _refuse_with_multi_turn(cfg: RLConfig) -> None:
    """multi_turn.enable: the combinations its tool rollouts do not support yet, refused by name."""
    key = "actor_rollout_ref.rollout.multi_turn.enable=true"
    if cfg.algorithm.adv_estimator == "prime":
        raise ConfigError(f"{key} with algorithm.adv_estimator=prime: PRIME's implicit PRM scores contiguous "
                          "responses; tool-response tokens inside a response are not supported")


def _extra_info(batch: Batch, i: int) -> dict:
    """Row i's extra_info for the reward function; an image prompt's PIL images under "images" (verl passes a
    row's images to custom reward functions the same way; rule scorers ignore the key); a multi-turn sample's tool
    calls' rewards under "tool_rewards" (verl's reward managers, and tiller eval's `score_samples`)."""
    extra = dict(batch["extra_info"][i] or {})
    if "images" in batch and batch["images"][i] is not None:
        extra.setdefault("images", list(batch["images"][i]))
    if "tool_rewards" in batch:
        extra["tool_rewards"] = list(batch["tool_rewards"][i])
    return extra
