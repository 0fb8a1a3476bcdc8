"""Pieces of the RL trainer checked with worked numbers and invariances (no full loop)."""

from __future__ import annotations

import math

import pytest
import torch

from tiller.config import load_config
from tiller.errors import ConfigError, UserError
from tiller.protocol import Batch
from tiller.trainer.rl_metrics import validation_metrics
from tiller.workers.common import lr_lambda, position_ids_from_mask, response_forward


def test_lr_schedule_worked_numbers():
    kw = dict(warmup=2, total=10, style="cosine", min_lr_ratio=0.0)
    assert lr_lambda(0, **kw) == 0.5  # (0 + 1) / 2
    assert lr_lambda(1, **kw) == 1.0
    assert lr_lambda(2, **kw) == 1.0  # progress 0 -> 0.5 (1 + cos 0) = 1
    assert math.isclose(lr_lambda(6, **kw), 0.5)  # progress (6-2)/8 = 0.5 -> 0.5 (1 + cos pi/2)
    assert math.isclose(lr_lambda(10, **kw), 0.0, abs_tol=1e-12)
    assert math.isclose(lr_lambda(10, **{**kw, "min_lr_ratio": 0.1}), 0.1)
    assert lr_lambda(7, warmup=0, total=10, style="constant", min_lr_ratio=0.0) == 1.0


def test_validation_metrics_mean_best_maj():
    # prompt p1: 3 samples, acc 1, 0, 0 with predictions "5", "4", "4" -> mean 1/3, best 1, maj ("4") 0
    # prompt p2: acc 1, 1, 0 with predictions "7", "7", "8"          -> mean 2/3, best 1, maj ("7") 1
    rows = [("ds", "p1", 1.0, 1.0, "5", "", ""), ("ds", "p1", 0.0, 0.0, "4", "", ""), ("ds", "p1", 0.0, 0.0, "4", "", ""),
            ("ds", "p2", 1.0, 1.0, "7", "", ""), ("ds", "p2", 1.0, 1.0, "7", "", ""), ("ds", "p2", 0.5, 0.0, "8", "", "")]
    m = validation_metrics(rows, 3)
    assert math.isclose(m["val-core/ds/acc/mean@3"], (1 / 3 + 2 / 3) / 2)
    assert m["val-core/ds/acc/best@3"] == 1.0
    assert m["val-core/ds/acc/maj@3"] == 0.5
    assert math.isclose(m["val-aux/ds/reward/mean@3"], (1 / 3 + 2.5 / 3) / 2)
    assert set(validation_metrics(rows[:1], 1)) == {"val-core/ds/acc/mean@1", "val-aux/ds/reward/mean@1"}


def _sequences(pad: int = 0):
    """3 rows, prompt width 4 (left pad), response width 3 (right pad)."""
    prompts = torch.tensor([[pad, pad, 11, 12], [pad, 21, 22, 23], [pad, pad, pad, 31]])
    responses = torch.tensor([[13, 14, pad], [24, pad, pad], [32, 33, 34]])
    pmask = (prompts != pad).long()
    rmask = (responses != pad).long()
    return prompts, responses, torch.cat([pmask, rmask], 1), rmask


def test_trimmed_forward_equals_full_width_forward(tiny_model_dir):
    from tiller.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir).eval()
    prompts, responses, attn, rmask = _sequences()
    ids = torch.cat([prompts, responses], 1)
    with torch.no_grad():
        logits, t_used = response_forward(model, ids, attn, 4, rmask)
        full = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    assert t_used == 3  # longest response
    # the logits at column P + t - 1 predict response token t
    torch.testing.assert_close(logits * rmask[..., None], full[:, 3:6] * rmask[..., None], atol=1e-5, rtol=1e-4)


def _grouped_sequences():
    """6 rows: prompts A (3 samples), B (2), C (1) of different lengths, left padded to P=5; responses of
    lengths 1..4 right padded to T=4 (B's two samples differ only after the first token)."""
    prompts = torch.tensor([[0, 0, 11, 12, 13]] * 3 + [[0, 21, 22, 23, 24]] * 2 + [[0, 0, 0, 31, 32]])
    responses = torch.tensor([[41, 42, 43, 0], [44, 0, 0, 0], [45, 46, 47, 48],
                              [51, 52, 0, 0], [51, 53, 54, 55], [61, 62, 63, 0]])
    pmask, rmask = (prompts != 0).long(), (responses != 0).long()
    return prompts, responses, torch.cat([pmask, rmask], 1), rmask


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2-value"])
def test_shared_prompt_forward_equals_per_sample_forward(tiny_model_dir, tiny_llama_dir, arch):
    # each distinct prompt runs once and its KV cache serves its samples: the same outputs and the same
    # gradients as one full forward per sample (for causal LMs the LM head on the response slots only, too)
    from transformers import AutoModelForTokenClassification

    from tiller.models.loading import load_causal_lm
    from tiller.workers.common import forward_options

    if arch == "qwen2-value":  # the critic's value model: no logits_to_keep, the cache is filled in place
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, config=config).train()
    else:
        model = load_causal_lm(tiny_model_dir if arch == "qwen2" else tiny_llama_dir).train()
    keep = arch != "qwen2-value"
    assert forward_options(model, True) == {"logits_to_keep": keep, "share_prompts": True}
    assert forward_options(model, False)["share_prompts"] is False
    prompts, responses, attn, rmask = _grouped_sequences()
    ids = torch.cat([prompts, responses], 1)
    weights = torch.randn(6, 4, 1, generator=torch.Generator().manual_seed(0))
    results = []
    for opts in ({}, {"logits_to_keep": keep}, {"logits_to_keep": keep, "share_prompts": True}):
        model.zero_grad()
        logits, t_used = response_forward(model, ids, attn, 5, rmask, **opts)
        assert t_used == 4 and logits.shape[:2] == (6, 4)
        (logits.log_softmax(-1) * rmask[..., None] * weights).sum().backward()
        results.append((logits.detach() * rmask[..., None],
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    with torch.no_grad():  # column P + t - 1 of the full-width forward predicts response token t
        full = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    torch.testing.assert_close(results[0][0], full[:, 4:8] * rmask[..., None], atol=1e-5, rtol=1e-4)
    for logits, grads in results[1:]:
        torch.testing.assert_close(logits, results[0][0], atol=1e-5, rtol=1e-4)
        assert grads.keys() == results[0][1].keys() and len(grads) > 10
        for name, g in grads.items():
            scale = float(results[0][1][name].abs().max()) + 1e-8
            torch.testing.assert_close(g / scale, results[0][1][name] / scale, atol=1e-4, rtol=1e-3)


def test_split_long_responses_worked_cases():
    from tiller.workers.common import split_long_responses

    def mask(lengths, width=6):
        return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()

    short, long = split_long_responses(mask([2] * 14 + [6] * 2))
    assert long.tolist() == [14, 15] and short.tolist() == list(range(14))
    short, long = split_long_responses(mask([3, 6] + [3] * 13 + [5]))  # two lengths among the long rows
    assert long.tolist() == [1, 15] and len(short) == 14
    assert split_long_responses(mask([3, 3, 6, 3, 3, 3, 5, 3] * 2)) is None  # 4 long rows > 16 // 8
    assert split_long_responses(mask([3] * 4 + [4] * 4)) is None  # half the rows are long: no outliers
    assert split_long_responses(mask([3] * 6 + [6])) is None  # fewer than 8 rows
    assert split_long_responses(mask([5] * 15 + [6])) is None  # one column for 15 rows: < 20% saved
    short, long = split_long_responses(mask([3] * 7 + [6]))
    assert long.tolist() == [7]


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-value"])
@pytest.mark.parametrize("share", [False, True])
def test_split_long_responses_forward_equals_one_forward(tiny_model_dir, arch, share):
    # 16 rows, two of them with 6-token responses and the rest 2: the two run as their own forward, the
    # others' outputs are padded; outputs on every response token and all gradients match one forward
    from transformers import AutoConfig, AutoModelForTokenClassification

    from tiller.models.loading import load_causal_lm
    from tiller.workers import common

    if arch == "qwen2-value":
        config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, config=config).train()
    else:
        model = load_causal_lm(tiny_model_dir).train()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 200, (4, 5), generator=g).repeat_interleave(4, 0)  # 4 prompts x 4 samples
    prompts[::3, :2] = 0  # some left padding
    lengths = torch.tensor([2] * 16)
    lengths[[5, 11]] = 6
    rmask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    responses = torch.randint(5, 200, (16, 6), generator=g) * rmask
    attn = torch.cat([(prompts != 0).long(), rmask], 1)
    ids = torch.cat([prompts, responses], 1)
    weights = torch.randn(16, 6, 1, generator=g)
    opts = {"logits_to_keep": arch == "qwen2", "share_prompts": share}
    calls = []
    inner = common._response_forward
    results = []
    for split in (False, True):
        model.zero_grad()
        if split:
            def counting(*args):
                calls.append(args[1].shape[0])
                return inner(*args)

            common._response_forward = counting
            try:
                out, t_used = common.response_forward(model, ids, attn, 5, rmask, **opts)
            finally:
                common._response_forward = inner
        else:
            out, t_used = inner(model, ids, attn, 5, rmask, opts["logits_to_keep"], share)
        assert t_used == 6 and out.shape[:2] == (16, 6)
        (out.log_softmax(-1) * rmask[..., None] * weights).sum().backward()
        results.append((out.detach() * rmask[..., None],
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert calls == [14, 2]  # the split ran: 14 short rows, then the 2 long ones
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-4)
    assert results[1][1].keys() == results[0][1].keys() and len(results[0][1]) > 10
    for name, grad in results[0][1].items():
        scale = float(grad.abs().max()) + 1e-8
        torch.testing.assert_close(results[1][1][name] / scale, grad / scale, atol=1e-4, rtol=1e-3)


def test_shared_prompt_forward_one_token_responses(tiny_model_dir):
    from tiller.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir).eval()
    prompts, responses, attn, rmask = _grouped_sequences()
    responses, rmask = responses[:, :1], rmask[:, :1]
    attn = torch.cat([attn[:, :5], rmask], 1)
    ids = torch.cat([prompts, responses], 1)
    with torch.no_grad():
        plain, _ = response_forward(model, ids, attn, 5, rmask)
        shared, t_used = response_forward(model, ids, attn, 5, rmask, logits_to_keep=True, share_prompts=True)
    assert t_used == 1
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-4)


def _worker(model_dir, micro: int, agg: str = "token-mean", *extra: str):
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=hf",
                       f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=4",
                       "actor_rollout_ref.rollout.n=2", f"actor_rollout_ref.actor.loss_agg_mode={agg}",
                       "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.grad_clip=1e9", *extra])
    return ActorRolloutRefWorker(cfg, total_training_steps=1)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_actor_update_is_micro_batch_invariant(tiny_model_dir, agg):
    # 8 samples with different response lengths: one micro-batch of 8 == four of 2 (global-count normalisation)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 300, (8, 4), generator=g)
    responses = torch.randint(5, 300, (8, 5), generator=g)
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])
    rmask = (torch.arange(5)[None] < lengths[:, None]).long()
    attn = torch.cat([torch.ones(8, 4, dtype=torch.long), rmask], 1)
    batch = Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                   "attention_mask": attn, "response_mask": rmask,
                   "advantages": torch.randn(8, 5, generator=g) * rmask,
                   "old_log_probs": -torch.rand(8, 5, generator=g) - 5.0},
                  meta={"mini_batch_size": 8, "temperature": 1.0})
    # Adam with eps=1 (>> |g|) and lr=1 makes the first update ~ -g, so the weight change compares gradients
    # (with a small eps Adam's g / |g| turns float noise in near-zero gradients into whole steps)
    deltas, metrics = [], []
    for micro in (8, 2):
        w = _worker(tiny_model_dir, micro, agg, "actor_rollout_ref.actor.optim.eps=1.0",
                    "actor_rollout_ref.actor.optim.lr=1.0", "actor_rollout_ref.actor.optim.weight_decay=0.0")
        before = w.state_dict()
        metrics.append(w.update_actor(batch))
        deltas.append({k: v - before[k] for k, v in w.state_dict().items()})
    scale = max(float(d.abs().max()) for d in deltas[0].values())
    assert scale > 1e-4  # the update did something
    for k in deltas[0]:
        torch.testing.assert_close(deltas[0][k], deltas[1][k], atol=1e-4 * scale, rtol=1e-3)
    assert math.isclose(metrics[0]["actor/pg_loss"], metrics[1]["actor/pg_loss"], rel_tol=1e-4, abs_tol=1e-6)
    assert math.isclose(metrics[0]["actor/grad_norm"], metrics[1]["actor/grad_norm"], rel_tol=1e-4)


def test_generate_sequences_layout(tiny_model_dir):
    w = _worker(tiny_model_dir, 8)
    prompts = Batch(fields={"prompt_ids": [[5, 6, 7], [8, 9]], "uid": ["a", "b"]},
                    meta={"sampling": {"n": 2, "max_new_tokens": 4, "seed": 3}, "prompt_width": 5, "response_width": 6})
    out = w.generate_sequences(prompts)
    assert len(out) == 4 and list(out["uid"]) == ["a", "a", "b", "b"]
    assert out["prompts"].shape == (4, 5) and out["responses"].shape == (4, 6)
    assert out["prompts"][2].tolist()[-2:] == [8, 9] and out["attention_mask"][2, :3].sum() == 0
    lengths = out["response_mask"].sum(-1)
    assert (lengths >= 1).all() and (lengths <= 4).all()
    # response_mask is a prefix; rollout logprobs are 0 on padding and < 0 on sampled tokens
    assert torch.equal(out["response_mask"], (torch.arange(6)[None] < lengths[:, None]).long())
    assert (out["rollout_log_probs"][out["response_mask"].bool()] <= 0).all()
    assert (out["rollout_log_probs"][~out["response_mask"].bool()] == 0).all()
    assert torch.equal(out["position_ids"][0, 2:5], torch.tensor([0, 1, 2]))


_MALLOC_SCRIPT = """
import ctypes, json, sys, torch
from tiller.workers.common import tune_cpu_malloc
if sys.argv[1] == "tuned":
    assert tune_cpu_malloc()
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):  # struct mallinfo2 (glibc >= 2.33): ten size_t fields
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
before = libc.mallinfo2()
block = torch.ones(24 << 18)  # a 24 MiB activation
during = libc.mallinfo2()
del block  # freed at the end of a step
after = libc.mallinfo2()
print(json.dumps({"mmapped_during": during.hblkhd - before.hblkhd, "heap_after": after.arena - before.arena}))
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc mallopt")
def test_tune_cpu_malloc_keeps_freed_blocks_mapped():
    # glibc's defaults serve a 24 MiB block with its own mmap and unmap it on free, so every step faults its
    # pages in afresh; tuned, the block comes from the heap and the heap keeps it after the free. Read from
    # glibc's own accounting (mallinfo2), which does not depend on the host's load or memory pressure.
    import json
    import subprocess
    import sys

    libc = __import__("ctypes").CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc < 2.33 has no mallinfo2")
    # growth of glibc's mmapped bytes while the block lives, and of the heap once it is freed
    info = {mode: json.loads(subprocess.run([sys.executable, "-c", _MALLOC_SCRIPT, mode], check=True, text=True,
                                            capture_output=True).stdout) for mode in ("plain", "tuned")}
    block = 24 << 20
    assert info["plain"]["mmapped_during"] >= block, info  # its own mapping, returned to the kernel on free
    assert info["tuned"]["mmapped_during"] < block, info  # from the heap instead ...
    assert info["tuned"]["heap_after"] >= block, info  # ... which keeps the freed pages (no trim)
    assert info["plain"]["heap_after"] < block, info


def test_progress_bar_only_on_a_terminal(monkeypatch):
    import sys
    from types import SimpleNamespace

    from tiller.trainer.rl import RLTrainer

    fake = SimpleNamespace(cfg=load_config(["trainer.progress=true"]), total_steps=5, global_step=1)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert RLTrainer._progress_bar(fake).disable  # piped / logged output: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = RLTrainer._progress_bar(fake)
    assert not bar.disable and bar.total == 5 and bar.n == 1  # resumed at step 1
    bar.close()
    fake.cfg.trainer.progress = False
    assert RLTrainer._progress_bar(fake).disable


def test_override_config_reaches_the_model_before_it_is_built(tiny_model_dir):
    """model.override_config is applied to the HF config before the model is built (as verl): the attention
    implementation switches and attention_dropout reaches the attention modules, in the actor, its reference
    copy and the critic; an unknown implementation is a UserError naming the key."""
    from tiller.workers.critic import CriticWorker

    ov = "actor_rollout_ref.model.override_config"
    from tiller.workers.actor import ActorRolloutRefWorker

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.name=hf",
                       f"+{ov}.attn_implementation=eager", f"+{ov}.attention_dropout=0.25"])
    w = ActorRolloutRefWorker(cfg, total_training_steps=1, need_ref=True)
    for module in (w.module, w.ref_module):
        assert module.config._attn_implementation == "eager"
        assert {layer.self_attn.attention_dropout for layer in module.model.layers} == {0.25}
    plain = _worker(tiny_model_dir, 8)
    assert plain.module.config._attn_implementation == "sdpa"
    assert plain.module.model.layers[0].self_attn.attention_dropout == 0.0
    critic = CriticWorker(load_config([f"actor_rollout_ref.model.path={tiny_model_dir}",
                                       "+critic.model.override_config.attn_implementation=eager"]),
                          total_training_steps=1)
    assert critic.module.config._attn_implementation == "eager"
    with pytest.raises(UserError, match=r"actor_rollout_ref\.model\.override_config\.attn_implementation='nope'"):
        _worker(tiny_model_dir, 8, "token-mean", f"+{ov}.attn_implementation=nope")
    with pytest.warns(UserWarning, match=rf"{ov}\.no_such_field: not a field of Qwen2Config"):
        _worker(tiny_model_dir, 8, "token-mean", f"+{ov}.no_such_field=1")


def test_rollout_max_num_seqs_reaches_the_native_engine(tiny_model_dir):
    """verl's rollout.max_num_seqs is the native engine's wave size (engine_kwargs.max_num_seqs wins where both are
    set); 0 is refused naming the key."""
    from tiller.workers.actor import ActorRolloutRefWorker

    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.name=native"]
    for extra, want in ((), 256), (("actor_rollout_ref.rollout.max_num_seqs=3",), 3), \
            (("actor_rollout_ref.rollout.max_num_seqs=3", "+actor_rollout_ref.rollout.engine_kwargs.max_num_seqs=5"), 5):
        worker = ActorRolloutRefWorker(load_config([*base, *extra]), total_training_steps=1)
        assert worker.rollout.max_num_seqs == want, extra
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.max_num_seqs"):
        load_config([*base, "actor_rollout_ref.rollout.max_num_seqs=0"])
