"""`tiller openrlhf JOB ... --dry-run`: the resolved tiller config of OpenRLHF command lines (batch units, KL
placement, schedule, OpenRLHF's defaults), notices, refusals, launcher stripping, and OpenRLHF's own example
scripts (`data/examples.txt`, flat and dotted spellings)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tiller.cli import main as tiller_main
from tiller.openrlhf.cli import resolve

EXAMPLES = Path(__file__).parent / "data" / "examples.txt"
PPO = ["train_ppo_ray", "--pretrain", "Qwen/Qwen2.5-7B", "--remote_rm_url", "http://rm:5000/get_reward",
       "--prompt_data", "OpenRLHF/prompt-collection-v0.1", "--input_key", "context_messages"]


def cfg_of(*argv: str):
    return resolve(list(argv))[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = tiller_main(["openrlhf", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------------------------ PPO


def test_ppo_batch_units_samples_vs_prompts():
    # --train_batch_size counts samples (prompts x n), --rollout_batch_size prompts: 128 samples / n 8 = 16 prompts
    cfg = cfg_of(*PPO, "--n_samples_per_prompt", "8", "--train_batch_size", "128", "--rollout_batch_size", "64",
                 "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "16", "--max_epochs", "2",
                 "--advantage_estimator", "gae")
    arr = cfg.actor_rollout_ref
    assert cfg.data.train_batch_size == 64 and arr.rollout.n == 8
    assert arr.actor.ppo_mini_batch_size == 16 and cfg.critic.ppo_mini_batch_size == 16
    assert arr.actor.ppo_micro_batch_size_per_gpu == 4 and arr.actor.ppo_epochs == 2
    assert arr.rollout.log_prob_micro_batch_size_per_gpu == 16 and arr.ref.log_prob_micro_batch_size_per_gpu == 16
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.ppo_epochs == 2
    assert cfg.critic.model.lora_rank == 0
    # --lora_rank: OpenRLHF's critic takes the actor's LoRA settings
    cfg = cfg_of(*PPO, "--advantage_estimator", "gae", "--lora_rank", "8", "--lora_alpha", "16", "--lora_dropout", "0.1")
    assert (cfg.critic.model.lora_rank, cfg.critic.model.lora_alpha) == (8, 16)
    assert cfg.actor_rollout_ref.model.lora_rank == 8
    # --lora_dropout: both models' adapters, in their updates' forwards (tests/trainer/test_lora_dropout_rl.py)
    assert cfg.actor_rollout_ref.model.lora_dropout == cfg.critic.model.lora_dropout == 0.1
    # --load_in_4bit (QLoRA): OpenRLHF's nf4 + double quantization on the actor and the critic (OpenRLHF's
    # get_llm_for_sequence_regression takes it too)
    pytest.importorskip("bitsandbytes")
    cfg = cfg_of(*PPO, "--advantage_estimator", "gae", "--lora_rank", "8", "--load_in_4bit")
    for model in (cfg.actor_rollout_ref.model, cfg.critic.model):
        assert (model.load_in_4bit, model.bnb_4bit_quant_type, model.bnb_4bit_use_double_quant) == (True, "nf4", True)


def test_ppo_async_flags_map_to_verls_async_keys(capsys):
    # OpenRLHF's generator runs up to --train.async_queue_size batches ahead: tiller's staleness bound
    cfg = cfg_of(*PPO, "--async_train", "actor_rollout_ref.rollout.name=native", "trainer.device=cpu")
    assert cfg.async_training.staleness_threshold == 1 and not cfg.async_training.partial_rollout
    dotted = ["train_ppo_ray", "--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl",
              "--reward.remote_url", "http://rm:5000/get_reward", "--train.async_enable", "--train.async_queue_size",
              "2", "--train.partial_rollout_enable", "actor_rollout_ref.rollout.name=native", "trainer.device=cpu"]
    cfg = cfg_of(*dotted)
    assert cfg.async_training.staleness_threshold == 2 and cfg.async_training.partial_rollout
    assert cfg_of(*PPO).async_training.staleness_threshold == 0  # without the flag: synchronous
    code, _, err = run(capsys, *[x for x in dotted if x != "--train.async_enable"], "--dry-run")
    assert code == 2 and "--train.partial_rollout_enable: refused: needs --train.async_enable" in err, err
    code, _, err = run(capsys, *PPO, "--async_train", "actor_rollout_ref.rollout.name=vllm", "--dry-run")
    assert code == 2 and "in-process engine" in err, err


def test_ppo_train_batch_not_a_multiple_of_n_is_refused(capsys):
    code, _, err = run(capsys, *PPO, "--n_samples_per_prompt", "3", "--train_batch_size", "128", "--dry-run")
    assert code == 2 and "--train_batch_size 128: refused" in err and "--n_samples_per_prompt (3)" in err


def test_ppo_openrlhf_defaults_written_out():
    cfg = cfg_of(*PPO)
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    # KL 0.01 in the reward (k1) unless --use_kl_loss; no KL loss
    assert algo.use_kl_in_reward is True and algo.kl_ctrl.kl_coef == 0.01 and algo.kl_penalty == "kl"
    assert algo.kl_ctrl.type == "fixed" and arr.actor.use_kl_loss is False
    # cosine to 0.1 x lr after 3% warm-up; AdamW betas (0.9, 0.95), weight decay 0; actor lr 1e-6, critic 9e-6
    opt = arr.actor.optim
    assert (opt.warmup_style, opt.min_lr_ratio, opt.lr_warmup_steps_ratio) == ("cosine", 0.1, 0.03)
    assert opt.betas == [0.9, 0.95] and opt.weight_decay == 0.0 and opt.lr == 1e-6 and cfg.critic.optim.lr == 9e-6
    assert cfg.trainer.seed == 42 and cfg.data.seed == 42
    assert cfg.data.apply_chat_template is False and cfg.trainer.resume_mode == "disable"
    assert arr.actor.clip_ratio_c >= 1e9  # no dual clip unless --dual_clip
    assert cfg.reward_model.clip_range == [-10.0, 10.0]
    assert cfg.reward_model.remote_url == "http://rm:5000/get_reward" and cfg.reward_model.remote_format == "openrlhf"
    assert cfg.data.prompt_key == "context_messages" and cfg.data.default_data_source == "openrlhf"
    assert algo.adv_estimator == "gae" and cfg.critic.model.path == "Qwen/Qwen2.5-7B"  # critic = policy (remote RM)
    assert cfg.data.max_prompt_length == 1024 and cfg.data.max_response_length == 1024


def test_ppo_kl_loss_placement_and_estimators():
    cfg = cfg_of(*PPO, "--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", "0.001",
                 "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4")
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 0.001 and actor.kl_loss_type == "low_var_kl"
    assert algo.use_kl_in_reward is False
    cfg = cfg_of(*PPO, "--kl_estimator", "k2", "--kl_target", "0.1", "--init_kl_coef", "0.05")
    assert cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "mse"
    assert cfg.algorithm.kl_ctrl.type == "adaptive" and cfg.algorithm.kl_ctrl.target_kl == 0.1
    cfg = cfg_of(*PPO, "--init_kl_coef", "0")
    assert cfg.algorithm.use_kl_in_reward is False and cfg.actor_rollout_ref.actor.use_kl_loss is False


def test_ppo_algorithm_mappings():
    cfg = cfg_of(*PPO, "--advantage_estimator", "dr_grpo", "--n_samples_per_prompt", "4", "--dual_clip", "3",
                 "--eps_clip_low_high", "0.2", "0.28", "--policy_loss_type", "gspo", "--entropy_loss_coef", "0.01",
                 "--dynamic_filtering", "--lr_scheduler", "constant_with_warmup", "--bf16", "--temperature", "0.7")
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    assert algo.adv_estimator == "grpo" and algo.norm_adv_by_std_in_grpo is False
    assert arr.actor.clip_ratio_c == 3.0 and (arr.actor.clip_ratio_low, arr.actor.clip_ratio_high) == (0.2, 0.28)
    assert arr.actor.policy_loss.loss_mode == "gspo" and arr.actor.entropy_coeff == 0.01
    assert algo.filter_groups.enable and algo.filter_groups.metric == "acc"
    assert arr.actor.optim.warmup_style == "constant" and arr.actor.dtype == "bfloat16"
    assert arr.rollout.temperature == 0.7
    for est, name in (("reinforce", "reinforce_plus_plus"), ("rloo", "rloo"),
                      ("reinforce_baseline", "reinforce_plus_plus_baseline")):
        assert cfg_of(*PPO, "--advantage_estimator", est, "--n_samples_per_prompt", "2").algorithm.adv_estimator == name


def test_ppo_eval_steps_minus_one_never_evaluates(capsys):
    assert cfg_of(*PPO, "--eval_dataset", "val.jsonl").data.val_files == []
    code, out, _ = run(capsys, *PPO, "--eval_dataset", "val.jsonl", "--dry-run")
    assert code == 0 and "notice: --eval_dataset: OpenRLHF never evaluates with --eval_steps -1" in out
    cfg = cfg_of(*PPO, "--eval_dataset", "val.jsonl", "--eval_steps", "5", "--eval_temperature", "0")
    assert cfg.data.val_files == ["val.jsonl"] and cfg.trainer.test_freq == 5
    assert cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is False and cfg.actor_rollout_ref.rollout.val_kwargs.n == 1
    val = cfg_of(*PPO, "--eval_dataset", "val.jsonl", "--eval_steps", "5").actor_rollout_ref.rollout.val_kwargs
    assert (val.n, val.temperature, val.do_sample) == (4, 0.6, True)


def test_ppo_reward_func_file_and_reward_model():
    cfg = cfg_of("train_ppo_ray", "--pretrain", "m", "--remote_rm_url", "/x/reward_func.py", "--prompt_data", "p.jsonl",
                 "--label_key", "answer", "--overlong_buffer_len", "64", "--generate_max_len", "256")
    assert cfg.reward_model.reward_manager == "openrlhf" and cfg.custom_reward_function.path == "/x/reward_func.py"
    assert cfg.custom_reward_function.name == "reward_func" and cfg.data.label_key == "answer"
    assert cfg.reward_model.overlong_buffer.enable and cfg.reward_model.overlong_buffer.len == 64
    cfg = cfg_of("train_ppo_ray", "--pretrain", "m", "--reward_pretrain", "rm", "--prompt_data", "p.jsonl",
                 "--normalize_reward", "--reward_clip_range", "-5", "5")
    assert cfg.reward_model.enable and cfg.reward_model.model.path == "rm" and cfg.reward_model.normalize
    assert cfg.reward_model.clip_range == [-5.0, 5.0] and cfg.critic.model.path == "rm"


def test_ppo_dotted_flags_resolve_like_flat():
    flat = cfg_of(*PPO, "--train_batch_size", "64", "--n_samples_per_prompt", "8", "--actor_learning_rate", "5e-7",
                  "--advantage_estimator", "group_norm", "--use_kl_loss", "--init_kl_coef", "1e-3",
                  "--generate_max_len", "512", "--prompt_max_len", "1024", "--rollout_batch_size", "32", "--bf16")
    dotted = cfg_of("train_ppo_ray", "--actor.model_name_or_path", "Qwen/Qwen2.5-7B", "--reward.remote_url",
                    "http://rm:5000/get_reward", "--data.prompt_dataset", "OpenRLHF/prompt-collection-v0.1",
                    "--data.input_key", "context_messages", "--train.batch_size", "64",
                    "--rollout.n_samples_per_prompt", "8", "--actor.adam.lr", "5e-7", "--algo.advantage.estimator",
                    "group_norm", "--algo.kl.use_loss", "--algo.kl.init_coef", "1e-3", "--data.max_len", "1536",
                    "--rollout.max_new_tokens", "512", "--rollout.batch_size", "32", "--rollout.micro_batch_size", "8",
                    "--train.micro_batch_size", "4")
    from tiller.config import to_dict

    a, b = to_dict(flat), to_dict(dotted)
    a["trainer"].pop("experiment_name"), b["trainer"].pop("experiment_name")
    assert a == b


# ------------------------------------------------------------------------------------------------ offline jobs


def test_sft_resolved_config():
    cfg = cfg_of("train_sft", "--pretrain", "meta-llama/Meta-Llama-3-8B", "--dataset", "a.jsonl,b.parquet",
                 "--dataset_probs", "0.7,0.3", "--input_key", "question", "--output_key", "response",
                 "--train_batch_size", "256", "--micro_train_batch_size", "2", "--max_len", "2048",
                 "--packing_samples", "--learning_rate", "5e-6", "--save_path", "./ckpt/sft")
    d, o, t = cfg.data, cfg.optim, cfg.trainer
    assert d.train_files == ["a.jsonl", "b.parquet"] and d.train_probs == [0.7, 0.3]
    assert (d.train_batch_size, d.micro_batch_size_per_gpu, d.max_length) == (256, 2, 2048)
    assert d.packing and d.input_key == "question" and d.output_key == "response" and d.truncation == "right"
    assert d.apply_chat_template is False and d.input_template == "User: {}\nAssistant: "
    assert (o.lr, o.lr_scheduler, o.min_lr_ratio, o.warmup_steps_ratio) == (5e-6, "cosine", 0.1, 0.03)
    assert o.betas == [0.9, 0.95] and o.weight_decay == 0.0 and o.dtype == "float32"
    assert t.seed == 42 and t.total_epochs == 2 and t.resume_mode == "disable" and t.default_local_dir == "./ckpt/sft"
    assert t.strategy == "fsdp"  # OpenRLHF's default --zero_stage 2
    assert cfg_of("train_sft", "--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a", "--zero_stage",
                  "1").trainer.strategy == "ddp"


def test_rm_dpo_kto_resolved_configs():
    rm = cfg_of("train_rm", "--pretrain", "m", "--dataset", "pairs.jsonl", "--loss", "logexp", "--margin_loss",
                "--load_checkpoint", "--bf16")
    assert rm.data.prompt_key is None and rm.algorithm.loss == "logexp" and rm.data.margin_key == "margin"
    assert rm.trainer.resume_mode == "auto" and rm.optim.dtype == "bfloat16" and rm.optim.lr == 9e-6
    assert rm.data.micro_batch_size_per_gpu == 1 and rm.data.max_length == 512
    dpo = cfg_of("train_dpo", "--pretrain", "m", "--dataset", "pairs.jsonl", "--beta", "0.2", "--label_smoothing",
                 "0.1", "--prompt_key", "prompt", "--ref_pretrain", "ref")
    assert dpo.algorithm.loss == "cdpo" and dpo.algorithm.beta == 0.2 and dpo.algorithm.label_smoothing == 0.1
    assert dpo.data.prompt_key == "prompt" and dpo.model.ref_path == "ref" and dpo.optim.min_lr_ratio == 0.1
    assert cfg_of("train_dpo", "--pretrain", "m", "--dataset", "p.jsonl", "--ipo").algorithm.loss == "ipo"
    kto = cfg_of("train_kto", "--dataset", "k.jsonl", "--input_key", "prompt", "--output_key", "completion",
                 "--desirable_loss_weight", "1.33")
    assert kto.model.partial_pretrain == "bigscience/bloomz-1b7"  # OpenRLHF's KTO default model
    assert kto.data.label_key == "label" and kto.data.completion_key == "completion"
    assert kto.algorithm.beta == 0.01 and kto.algorithm.desirable_weight == 1.33
    assert kto.data.input_template == "User: {}\nAssistant: "


# ------------------------------------------------------------------------------------------------ the command


def test_hints_print_one_notice_each_and_dry_run_creates_nothing(capsys, tmp_path):
    out_dir = tmp_path / "out"
    code, out, _ = run(capsys, "deepspeed", "--include", "localhost:0,1", "--module", "openrlhf.cli.train_sft",
                       "--pretrain", "hub/model", "--dataset", "hub/data", "--output_key", "a", "--zero_stage", "3",
                       "--flash_attn", "--adam_offload", "--save_path", str(out_dir), "--dry-run")
    assert code == 0
    assert "launcher prefix stripped: deepspeed --include localhost:0,1 --module (this runs one process; for N: " \
           "torchrun --nproc_per_node N -m tiller.cli openrlhf ...)" in out
    notices = [line for line in out.splitlines() if line.startswith("notice:")]
    assert "strategy: fsdp" in out and sum("--flash_attn" in n for n in notices) == 1
    assert sum("--adam_offload" in n for n in notices) == 1
    assert "# tiller sft (from OpenRLHF train_sft, flat flags)" in out and "tiller sft model.partial_pretrain=" in out
    assert not out_dir.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, needle", [
    (["--load_in_4bit"], "model.load_in_4bit=true needs LoRA"),
    (["--lr_scheduler", "reduce_lr_on_plateau"], "--lr_scheduler reduce_lr_on_plateau: refused"),
    (["--not_a_flag", "1"], "unrecognized OpenRLHF flat argument(s): --not_a_flag"),
    (["--ds.zero_stage", "3"], "mixes dotted 0.10+ flags with flat 0.8.x ones (--pretrain --dataset --output_key)"),
])
def test_refusals_exit_2_naming_the_flag(capsys, argv, needle):
    code, _, err = run(capsys, "train_sft", "--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a", *argv,
                       "--dry-run")
    assert code == 2 and needle in err, err


def test_transformers_schedules_map_with_their_default_keywords():
    cfg = cfg_of("train_sft", "--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a", "--lr_scheduler",
                 "polynomial")
    assert (cfg.optim.lr_scheduler, cfg.optim.lr_scheduler_kwargs, cfg.optim.min_lr_ratio) == ("polynomial", {}, 0.0)
    cfg = cfg_of(*PPO, "--lr_scheduler", "inverse_sqrt")
    assert cfg.actor_rollout_ref.actor.optim.warmup_style == "inverse_sqrt"


def test_refused_flag_at_its_default_passes_and_abbreviations_work():
    cfg = cfg_of("train_rm", "--pretrain", "m", "--dataset", "d.jsonl", "--value_head_prefix", "score",
                 "--micro_train_batch", "4")  # argparse prefix, as OpenRLHF allows
    assert cfg.data.micro_batch_size_per_gpu == 4


def test_ring_attention_is_a_notice_and_packing_packs_the_ppo_update(capsys):
    """Ring attention / context parallelism split sequences over GPUs without changing the math: tiller splits them
    with Ulysses (the ring's head layout is a notice naming it); --packing_samples packs PPO's actor and critic
    micro-batches."""
    code, out, _ = run(capsys, "train_rm", "--pretrain", "m", "--dataset", "d.jsonl", "--ring_attn_size", "2",
                       "--ring_head_stride", "2", "--dry-run")
    notices = [line for line in out.splitlines() if line.startswith("notice:")]
    assert code == 0 and sum("--ring_head_stride 2: ring attention's head layout" in n for n in notices) == 1
    assert any("ulysses_sequence_parallel_size" in n for n in notices)
    rm = cfg_of("train_rm", "--pretrain", "m", "--dataset", "d.jsonl", "--ring_attn_size", "2")
    assert rm.ulysses_sequence_parallel_size == 2  # tiller rm's own split under torchrun
    sft = cfg_of("train_sft", "--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a", "--ring_attn_size", "2")
    assert sft.ulysses_sequence_parallel_size == 2  # tiller sft's own split under torchrun
    dpo = cfg_of("train_dpo", "--pretrain", "m", "--dataset", "d.jsonl", "--ring_attn_size", "2")
    assert dpo.ulysses_sequence_parallel_size == 2
    cfg = cfg_of(*PPO, "--packing_samples", "--advantage_estimator", "gae")
    assert cfg.actor_rollout_ref.model.use_remove_padding is True and cfg.critic.model.use_remove_padding is True
    assert cfg_of(*PPO).actor_rollout_ref.model.use_remove_padding is False
    # the token budget is OpenRLHF's per GPU of the ring: a micro-batch holds budget x ring tokens, and at least one
    # whole sequence (OpenRLHF runs a longer one alone)
    dyn = (*PPO, "--use_dynamic_batch", "--prompt_max_len", "512", "--generate_max_len", "512", "--ring_attn_size", "2")
    cfg = cfg_of(*dyn, "--train_max_tokens_per_gpu", "800")
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 1600
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 1600
    code, out, _ = run(capsys, *dyn, "--train_max_tokens_per_gpu", "300", "--dry-run")
    assert code == 0 and "--train_max_tokens_per_gpu 300 x 2 (ring attention x tensor parallel group) is below one " \
        "whole sequence of 1024 tokens" in out
    assert cfg_of(*dyn, "--train_max_tokens_per_gpu", "300").actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 1024


def test_tiller_overrides_after_the_flags():
    cfg = cfg_of("train_sft", "--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a", "trainer.device=cpu",
                 "trainer.total_training_steps=3")
    assert cfg.trainer.total_training_steps == 3


def test_python_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-m", "tiller.openrlhf.train_dpo", "--pretrain", "m", "--dataset", "d.jsonl",
                        "--dry-run"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "# tiller dpo (from OpenRLHF train_dpo, flat flags)" in r.stdout and list(tmp_path.iterdir()) == []
    r = subprocess.run([sys.executable, "-m", "tiller.openrlhf.train_dpo", "--pretrain", "m", "--dataset", "d.jsonl",
                        "--nll_loss_coef", "0.2"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2 and "--nll_loss_coef 0.2: refused" in r.stderr


def examples() -> list[tuple[str, str, list[str]]]:
    out, name, expect = [], "", ""
    for line in EXAMPLES.read_text().splitlines():
        if line.startswith(("# v", "# automodel@")):
            name = line[2:]
        elif line.startswith("# expect: "):
            expect = line[len("# expect: "):]
        elif line and not line.startswith("#"):
            out.append((name, expect, shlex.split(line)))
    return out


@pytest.mark.parametrize("name, expect, argv", examples(), ids=[e[0] for e in examples()])
def test_openrlhf_example_scripts_dry_run(capsys, tmp_path, monkeypatch, name, expect, argv):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv, "--dry-run")
    if expect == "ok":
        assert code == 0, err
        assert "# the same run as a tiller command line:" in out
    elif expect.startswith("error "):
        assert code == 2 and expect[len("error "):] in err, err
    else:
        flag = expect.split()[1]
        assert code == 2 and f"error: {flag} " in err and ": refused: " in err, err
    assert list(tmp_path.iterdir()) == []


def test_example_counts():
    kinds = [e[1] for e in examples()]
    assert len(kinds) == 32 and sum(k == "ok" for k in kinds) == 32
    assert sum(" --" in " ".join(e[2]) and "--data." in " ".join(e[2]) for e in examples()) == 18  # dotted ones
    fsdp = [e for e in examples() if e[0].startswith("automodel@")]  # OpenRLHF's FSDP2 backend branch
    assert len(fsdp) == 9 and all(any(t.startswith("--fsdp.") for t in e[2]) for e in fsdp)
