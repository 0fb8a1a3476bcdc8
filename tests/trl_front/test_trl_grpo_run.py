"""GRPO through tiller.trl end to end on a ~1M-parameter model: the example learns and logs the reward function's
values; one step equals `tiller rl` with the translated keys; LoRA on loaded objects saves a merged model; resume;
a raising reward function stops the run naming it."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import pytest
import torch

from tiller.cli import main as tiller_main
from tiller.errors import UserError
from tiller.trl import GRPOConfig, GRPOTrainer
from tiller.trl.common import overrides

ROOT = Path(__file__).resolve().parents[2]
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
'''


def digits(completions, **kwargs):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def chars(completions, **kwargs):
    return [len(text) / 10 for text in completions]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _args(run_dir, **kw):
    base = dict(output_dir=str(run_dir), num_generations=4, per_device_train_batch_size=8, max_completion_length=5,
                learning_rate=1e-2, max_steps=2, bf16=False, seed=3)
    return GRPOConfig(**{**base, **kw})


def _rows(n=8):
    return [{"prompt": f"Question {i}:", "weight": 1.0} for i in range(n)]


def test_example_learns_and_logs_the_reward_functions_values(tmp_path, tiny_model_dir):
    out = tmp_path / "ex"
    out.mkdir()
    os.symlink(tiny_model_dir, out / "tiny_model")  # the example's model: the same tiny-model kit build
    example = runpy.run_path(str(ROOT / "examples" / "trl_grpo.py"))
    result = example["main"](["--out", str(out), "--steps", "12"])
    assert result["steps"] == 12
    assert result["last3"] > result["first3"] + 0.3, result  # ~0.02 -> ~1.4 on the dev host
    run = out / "run"
    rows = {r["prompt"]: r for r in [{"prompt": f"Question {i}: count to {i % 7 + 2}.", "weight": 1.0 + (i % 2)}
                                     for i in range(32)]}
    history = {row["step"]: row for row in _jsonl(run / "metrics.jsonl")}
    for step in (1, 12):  # every logged completion's reward is the function's value on it and its row's weight
        dump = _jsonl(run / "completions" / f"{step}.jsonl")
        assert len(dump) == 32
        want = example["digit_reward"]([d["output"] for d in dump], [rows[d["input"]]["weight"] for d in dump])
        assert [d["score"] for d in dump] == pytest.approx(want, abs=1e-6)
        assert [d["digit_reward"] for d in dump] == pytest.approx(want, abs=1e-6)
        assert history[step]["rewards/digit_reward/mean"] == pytest.approx(sum(want) / 32, abs=1e-6)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(run)  # save_model(): a plain Hugging Face dir in output_dir
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), start.state_dict().values()))


def test_a_grpo_step_equals_tiller_rl_with_the_translated_keys(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=digits, args=_args(tmp_path / "trl", max_steps=1),
                          train_dataset=_rows())
    trainer.train()
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    keys = dict(trainer.tiller_keys, **{"trainer.default_local_dir": str(tmp_path / "cli"),
                                        "custom_reward_function.path": str(tmp_path / "reward.py")})
    assert tiller_main(["rl", *overrides(keys)]) == 0
    ours, cli = _jsonl(tmp_path / "trl" / "metrics.jsonl"), _jsonl(tmp_path / "cli" / "metrics.jsonl")
    assert len(ours) == len(cli) == 1
    for a, b in zip(ours, cli):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "critic/advantages/max",
                    "response_length/mean", "actor/lr"):
            assert a[key] == b[key], key
    assert trainer.state.global_step == 1 and [r["step"] for r in trainer.state.log_history] == [1]
    assert trainer.state.log_history[0]["rewards/digits/mean"] == pytest.approx(ours[0]["critic/score/mean"], abs=1e-6)


def test_lora_on_loaded_objects_saves_a_merged_model_and_resume_continues(tmp_path, tiny_model_dir):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    args = _args(tmp_path / "run", max_steps=1, learning_rate=5e-2)
    trainer = GRPOTrainer(model=model, reward_funcs=chars, args=args, train_dataset=_rows(), processing_class=tok,
                          peft_config=lora)
    trainer.train()
    assert trainer.tiller_keys["actor_rollout_ref.model.lora_rank"] == 4
    assert trainer.tiller_keys["actor_rollout_ref.model.path"] == str(tmp_path / "run" / "input_model")
    trainer.save_model(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # LoRA merged: a plain model
    assert not any("lora" in name for name in merged.state_dict())
    changed = [n for n, p in merged.state_dict().items() if not torch.equal(p, model.state_dict()[n])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
    trained = trainer.model.state_dict()  # trainer.model after train(): the trained model, LoRA merged
    assert all(torch.equal(trained[n], p) for n, p in merged.state_dict().items())
    # resume: a second trainer on the same output_dir continues from the checkpoint to max_steps=2
    again = GRPOTrainer(model=model, reward_funcs=chars, args=_args(tmp_path / "run", max_steps=2, learning_rate=5e-2),
                        train_dataset=_rows(), processing_class=tok, peft_config=lora)
    out = again.train(resume_from_checkpoint=True)
    assert out.global_step == 2 and [r["step"] for r in again.state.log_history] == [1, 2]


def test_a_raising_reward_function_stops_the_run_naming_it(tmp_path, tiny_model_dir):
    def picky(completions, weight, **kwargs):
        raise ValueError("no weight for this one")

    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[digits, picky], args=_args(tmp_path / "run"),
                          train_dataset=_rows())
    with pytest.raises(UserError, match="^reward function 'picky' raised ValueError: no weight for this one$"):
        trainer.train()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=digits, args=_args(tmp_path / "run", max_steps=1),
                          train_dataset=_rows())
    assert trainer.train().global_step == 1  # the failed run left the run dir usable


def test_mask_truncated_completions_leaves_them_out_of_the_loss(tmp_path, tiny_model_dir):
    # 3 tokens: every completion of an untrained model is cut (no EOS), so nothing is left to train on
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=chars, train_dataset=_rows(),
                          args=_args(tmp_path / "run", max_steps=1, max_completion_length=3,
                                     mask_truncated_completions=True))
    trainer.train()
    row = _jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["actor/masked_truncated_frac"] == 1.0 and row["response/finish_stop_ratio"] == 0.0
    assert row["actor/grad_norm"] == 0.0 and row["actor/pg_loss"] == 0.0


def test_normalize_then_sum_with_none_rewards_trains_on_trls_advantages(tmp_path, tiny_model_dir):
    # two functions, the second None for every other completion (it does not apply there): GDPO over sequences; the
    # logged advantages' extremes are those of TRL's normalize_then_sum over the dumped per-function rewards
    from tests.trl_front.test_trl_rewards_and_math import _trl_normalize_then_sum

    def sparse(completions, **kwargs):
        return [None if i % 2 else len(c) / 10 + (i % 3) for i, c in enumerate(completions)]

    args = _args(tmp_path / "run", max_steps=1, multi_objective_aggregation="normalize_then_sum",
                 reward_weights=[1.0, 2.0], log_completions=True, loss_type="vespo")
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[chars, sparse], args=args, train_dataset=_rows())
    trainer.train()
    dumped = _jsonl(tmp_path / "run" / "completions" / "1.jsonl")
    by_prompt: dict[str, list] = {}
    for row in dumped:
        by_prompt.setdefault(row["input"], []).append([row["chars"], row["sparse"] if row["sparse"] is not None
                                                       else float("nan")])
    per_func = torch.tensor([v for rows in by_prompt.values() for v in rows], dtype=torch.float32)
    assert per_func.shape == (8, 2) and torch.isnan(per_func[:, 1]).sum() == 4
    want = _trl_normalize_then_sum(per_func, torch.tensor([1.0, 2.0]), 4)
    row = _jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["critic/advantages/max"] == pytest.approx(float(want.max()), abs=1e-5)
    assert row["critic/advantages/min"] == pytest.approx(float(want.min()), abs=1e-5)
    assert row["actor/grad_norm"] > 0 and row["actor/vespo_phi_mean"] == pytest.approx(1.0)  # on-policy: w = 1


def test_adaptive_entropy_follows_trls_controller(tmp_path, tiny_model_dir):
    # a target above the untrained model's entropy (~6 nats): the coefficient rises each step to its cap; the bonus
    # applies from the second step on (the first is gated by TRL's initial inf entropy)
    args = _args(tmp_path / "run", max_steps=3, use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.02,
                 entropy_coef_max=0.04, entropy_target=50.0)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=chars, args=args, train_dataset=_rows())
    trainer.train()
    history = trainer.state.log_history
    assert [r["entropy_coef"] for r in history] == pytest.approx([0.03, 0.04, 0.04])
    assert [r["actor/entropy_coeff"] for r in history] == pytest.approx([0.0, 0.03, 0.04])


def test_sync_ref_model_moves_the_reference_as_trls_callback(tmp_path, tiny_model_dir):
    # beta > 0 (a reference) and sync every optimizer step with alpha 1: the reference is the policy after each
    # step, so step 2's KL is measured against the step-1 policy, and the checkpoint keeps the moved reference
    # (TRL's default use_bias_correction_kl=True: the KL term is weighted by the importance ratio)
    from transformers import AutoModelForCausalLM

    args = _args(tmp_path / "run", max_steps=2, beta=0.04, sync_ref_model=True,
                 ref_model_sync_steps=1, ref_model_mixup_alpha=1.0, learning_rate=5e-2)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=chars, args=args, train_dataset=_rows())
    trainer.train()
    assert trainer.tiller_keys["actor_rollout_ref.ref.ref_model_sync_steps"] == 1
    assert trainer.tiller_keys["actor_rollout_ref.actor.kl_loss_importance_weight"] is True
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_2"
    ref = AutoModelForCausalLM.from_pretrained(ckpt / "ref").state_dict()
    policy = AutoModelForCausalLM.from_pretrained(ckpt / "model").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.equal(ref[k], policy[k]) for k in policy)
    assert any(not torch.equal(policy[k], start[k]) for k in start)


def test_generation_kwargs_stop_ends_completions_at_the_string(tmp_path, tiny_model_dir):
    # generation_kwargs={"stop": [...]} (vLLM's SamplingParams keyword): a completion ends with the token that
    # completes the stop string, never runs past it
    args = _args(tmp_path / "run", max_steps=1, max_completion_length=24, log_completions=True,
                 generation_kwargs={"stop": ["e"]})
    GRPOTrainer(model=str(tiny_model_dir), reward_funcs=chars, args=args, train_dataset=_rows()).train()
    outputs = [row["output"] for row in _jsonl(tmp_path / "run" / "completions" / "1.jsonl")]
    stopped = [o for o in outputs if "e" in o]
    assert stopped, outputs  # the untrained model writes an "e" in some completions within 24 tokens
    assert all(len(o) - o.index("e") <= 8 for o in stopped), stopped  # the "e" sits in the last token
