"""One GRPO step of tiller's driver against a plain-torch reference of the same step.

The reference below (~100 lines) is written from the papers, not from tiller's code: a full forward per
sample (no trimming, no shared prompt), log-softmax at temperature, GRPO's group z-score with the unbiased
std (Shao et al. 2024, eq. 3 outcome supervision), DAPO's filter of equal-reward groups, PPO's clipped
surrogate (Schulman et al. 2017) averaged over the mini-batch's tokens, global grad-norm clipping and
torch's AdamW. tiller's `RLTrainer.train_step` runs on the same sampled batch (recorded through the
worker group), and the test asserts the same sampling log-probs, advantages, loss, gradients and updated
weights, with the shared-prompt forward on and off, on-policy (one mini-batch, the demo's setting) and with
two mini-batches (the second one off-policy, so the clip is live).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiller.config import load_config
from tiller.tasks import arithmetic

REWARD_SRC = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
             "    return float(sum(map(ord, solution_str)) % 2)\n"
LR, CLIP, TEMP, N = 1e-2, 0.2, 0.9, 4
# Adam's first step is lr * g / (|g| + eps): with eps = 1e-8, float rounding in gradients near zero (the two
# sides sum the same terms in a different order) becomes whole lr-sized steps; eps = 1e-4 keeps the update
# a smooth function of the gradient, so equal weights mean equal gradients
EPS = 1e-4


# ------------------------------------------------------------------------------------------ reference
def ref_logprobs(model, prompts, responses, attn, temperature):
    """log pi(y_t | x, y_<t) for every response slot [B, T]; one plain forward per whole sequence."""
    ids = torch.cat([prompts, responses], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float() / temperature
    P = prompts.shape[1]
    logp = logits[:, P - 1:-1].log_softmax(-1)  # column P + t - 1 predicts response token t
    return logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def ref_advantages(scores, n, eps=1e-6):
    """GRPO: (r - mean_g) / (std_g + eps) per group of n adjacent samples, unbiased std; [B]."""
    g = scores.view(-1, n)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).view(-1)


def ref_step(model, opt, prompts, responses, attn, rmask, adv, old_logp, grad_clip):
    """One mini-batch: token-mean clipped surrogate, backward, clip, AdamW; returns (loss, grads, norm)."""
    logp = ref_logprobs(model, prompts, responses, attn, TEMP)
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None].expand_as(logp)
    surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP))
    surrogate = torch.where(a < 0, torch.minimum(surrogate, -a * 3.0), surrogate)  # dual clip, c = 3
    m = rmask.float()
    loss = (surrogate * m).sum() / m.sum()
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    return float(loss), grads, float(norm)


# ---------------------------------------------------------------------------------------------- test
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_ref")
    arithmetic.write_task(root, n_train=16, n_test=4, seed=1)
    (root / "reward.py").write_text(REWARD_SRC)
    return root


def _spy(trainer):
    """Record each worker call's input and output; capture the gradients at each optimizer step."""
    calls, grads = {}, []
    execute, worker = trainer.actor.execute, trainer.actor.worker
    step = worker.optimizer.step

    def spy(method, *args, **kw):
        out = execute(method, *args, **kw)
        calls.setdefault(method, []).append((args, out))
        return out

    def step_and_record(*a, **kw):
        grads.append({k: p.grad.clone() for k, p in worker.module.named_parameters()})
        return step(*a, **kw)

    trainer.actor.execute, worker.optimizer.step = spy, step_and_record
    return calls, grads


@pytest.mark.parametrize("share", [True, False], ids=["shared_prompt", "per_sample"])
@pytest.mark.parametrize("minis", [1, 2], ids=["on_policy", "two_minibatches"])
def test_grpo_step_equals_plain_torch_reference(tiny_model_dir, data_dir, tmp_path, share, minis):
    from tiller.trainer.rl import RLTrainer

    cfg = load_config([
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{data_dir / 'train.parquet'}]",
        f"custom_reward_function.path={data_dir / 'reward.py'}", "data.apply_chat_template=false",
        "data.train_batch_size=4", "data.max_prompt_length=8", "data.max_response_length=5",
        "algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=1",  # one generation round: train on the groups that pass
        f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.rollout.temperature={TEMP}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={4 // minis}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.share_prompt_forward={share}", f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.grad_clip=0.5", f"actor_rollout_ref.actor.optim.eps={EPS}", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.shuffle=false", "actor_rollout_ref.rollout.dtype=float32", "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
        "trainer.val_before_train=false", "trainer.resume_mode=disable", f"trainer.default_local_dir={tmp_path}",
    ])
    trainer = RLTrainer(cfg)
    trainer.global_step = 1  # as fit() does before each step
    calls, tiller_grads = _spy(trainer)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    metrics = trainer.train_step()
    after = trainer.actor.execute("state_dict")
    trainer.shutdown()

    gen = calls["generate_sequences"][0][1]
    prompts, responses, attn, rmask = gen["prompts"], gen["responses"], gen["attention_mask"], gen["response_mask"]
    # 1. the rollout's sampling log-probs are the policy's (temperature applied)
    with torch.no_grad():
        logp0 = ref_logprobs(ref, prompts, responses, attn, TEMP)
    torch.testing.assert_close(gen["rollout_log_probs"] * rmask, logp0 * rmask, atol=1e-4, rtol=0)
    # 2. rewards -> GRPO advantages -> equal-reward groups dropped
    texts = [trainer.tokenizer.decode(r[:int(m.sum())], skip_special_tokens=True) for r, m in zip(responses, rmask)]
    scores = torch.tensor([float(sum(map(ord, t)) % 2) for t in texts])
    adv = ref_advantages(scores, N)
    keep = scores.view(-1, N).std(1).repeat_interleave(N) > 0
    assert 0 < int(keep.sum()) < len(keep) or keep.all(), (texts, scores)
    upd = calls["update_actor"][0][0][0]
    assert len(upd) == int(keep.sum())
    torch.testing.assert_close(upd["advantages"], (adv[:, None] * rmask)[keep], atol=1e-6, rtol=0)
    # 3. the update: per mini-batch, token-mean loss, clipped grad norm, AdamW (weight decay 0.01)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.01)
    p, r, a, m, ad = prompts[keep], responses[keep], attn[keep], rmask[keep], adv[keep]
    with torch.no_grad():
        old = ref_logprobs(ref, p, r, a, TEMP)  # behaviour policy = the weights that sampled
    size = upd.meta["mini_batch_size"]
    losses, norms = [], []
    for k, start in enumerate(range(0, len(p), size)):
        s = slice(start, start + size)
        loss, grads, norm = ref_step(ref, opt, p[s], r[s], a[s], m[s], ad[s], old[s], grad_clip=0.5)
        losses.append(loss)
        norms.append(norm)
        for name, g in grads.items():
            scale = float(g.abs().max()) + 1e-12
            torch.testing.assert_close(tiller_grads[k][name] / scale, g / scale, atol=5e-6, rtol=0,
                                       msg=lambda msg: f"mini-batch {k}, grad of {name}: {msg}")
    assert len(tiller_grads) == len(losses) == math.ceil(len(p) / size)
    assert metrics["actor/pg_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(sum(norms) / len(norms), rel=1e-5)
    for name, w in ref.state_dict().items():
        torch.testing.assert_close(after[name], w, atol=1e-6, rtol=0, msg=lambda msg: f"weight {name}: {msg}")
    assert any(not torch.equal(after[k], v) for k, v in AutoModelForCausalLM.from_pretrained(
        tiny_model_dir).state_dict().items())  # the step changed the model


def test_entropy_and_off_policy_masks_equal_the_reference(tiny_model_dir, data_dir, tmp_path):
    """actor.top_entropy_quantile (the policy gradient on each micro-batch's high-entropy half of the tokens) and
    actor.off_policy_mask_threshold (OPSM against the rollout's log-probs, which the test shifts by +0.5 on every
    other row so that some negative-advantage rows are far off-policy): the gradients of the reference's masked
    surrogate, TRL's definitions (torch.quantile over the micro-batch's valid tokens, >= kept; mean KL > threshold
    with a negative advantage dropped)."""
    from tiller.trainer.rl import RLTrainer

    cfg = load_config([
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files=[{data_dir / 'train.parquet'}]",
        f"custom_reward_function.path={data_dir / 'reward.py'}", "data.apply_chat_template=false",
        "data.train_batch_size=4", "data.max_prompt_length=8", "data.max_response_length=5",
        "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.rollout.temperature={TEMP}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.grad_clip=0.5",
        f"actor_rollout_ref.actor.optim.eps={EPS}", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.top_entropy_quantile=0.5", "actor_rollout_ref.actor.off_policy_mask_threshold=0.1",
        "actor_rollout_ref.actor.shuffle=false", "actor_rollout_ref.rollout.dtype=float32",
        "trainer.total_training_steps=1", "trainer.logger=[jsonl]", "trainer.val_before_train=false",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={tmp_path}",
    ])
    trainer = RLTrainer(cfg)
    trainer.global_step = 1
    calls, tiller_grads = _spy(trainer)
    execute = trainer.actor.execute

    def shift_behaviour(method, *args, **kw):  # rows 0, 2, 4, ...: the rollout log-probs 0.5 above the policy's
        if method == "update_actor":
            batch = args[0]
            batch["rollout_log_probs"][::2] += 0.5 * batch["response_mask"][::2]
        return execute(method, *args, **kw)

    trainer.actor.execute = shift_behaviour
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    metrics = trainer.train_step()
    trainer.shutdown()

    upd = calls["update_actor"][0][0][0]
    p, r, a, m = upd["prompts"], upd["responses"], upd["attention_mask"], upd["response_mask"].float()
    adv, behaviour = upd["advantages"], upd["rollout_log_probs"]
    ids = torch.cat([p, r], 1)
    logits = ref(input_ids=ids, attention_mask=a, position_ids=(a.cumsum(-1) - 1).clamp(min=0)).logits.float() / TEMP
    logits = logits[:, p.shape[1] - 1:-1]
    logp = logits.log_softmax(-1).gather(-1, r.unsqueeze(-1)).squeeze(-1)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).detach()
    keep_tok = torch.zeros_like(m)
    for s in (slice(i, i + 2) for i in range(0, len(m), 2)):  # per micro-batch of 2 rows: its top half by entropy
        threshold = torch.quantile(entropy[s][m[s].bool()], 0.5)
        keep_tok[s] = ((entropy[s] * m[s] >= threshold) & m[s].bool()).float()
    mean_kl = ((behaviour - logp.detach()) * m).sum(-1) / m.sum(-1)
    keep_row = ((adv.sum(-1) / m.sum(-1) >= 0) | (mean_kl <= 0.1)).float()
    assert 0 < keep_tok.sum() < m.sum() and 0 < keep_row.sum() < len(keep_row), (keep_tok, keep_row, adv)
    ratio = torch.exp(logp - logp.detach())  # on-policy: old = the weights that sampled
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * 3.0), surrogate)
    loss = (surrogate * keep_tok * keep_row[:, None] * m).sum() / m.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    for name, param in ref.named_parameters():
        scale = float(param.grad.abs().max()) + 1e-12
        torch.testing.assert_close(tiller_grads[0][name] / scale, param.grad / scale, atol=5e-6, rtol=0,
                                   msg=lambda msg: f"grad of {name}: {msg}")
    assert metrics["actor/pg_loss"] == pytest.approx(float(loss), abs=1e-6)
    assert metrics["actor/entropy_mask_frac"] == pytest.approx(float(keep_tok.sum() / m.sum()), abs=1e-6)
    assert metrics["actor/opsm_dropped_frac"] == pytest.approx(float(((1 - keep_row[:, None]) * m).sum() / m.sum()),
                                                               abs=1e-6)
