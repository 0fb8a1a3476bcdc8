"""`tiller dpo` / `tiller kto`: losses equal hand computations on fixed log-probs; training widens the margin."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.sft.conftest import job_overrides, write_jsonl
from tiller.config import load_config
from tiller.config.jobs import DPOConfig, KTOConfig, validate_job
from tiller.data.preference import load_preference_examples
from tiller.models.loading import load_causal_lm, load_tokenizer
from tiller.trainer.preference import DPOJob, KTOJob, Reference, train_dpo, train_kto

ROWS = [{"prompt": f"What is {a} + {b}?", "chosen": f"The answer is {a + b}.", "rejected": "I do not know.",
         "ref_c": -30.0 - a, "ref_r": -20.0 + b / 4} for a, b in [(1, 2), (3, 4), (5, 6)]]


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _hand_logp(model, tok, prompt: str, completion: str) -> tuple[float, int]:
    """Sum of log pi(completion tokens | prompt) by direct log_softmax + gather, and the token count."""
    p_text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    p_ids = tok(p_text, add_special_tokens=False)["input_ids"]
    c_ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p_ids + c_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return sum(logp[len(p_ids) + j - 1, t].item() for j, t in enumerate(c_ids)), len(c_ids)


@pytest.fixture(scope="module")
def tok_model(tiny_model_dir):
    return load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir).eval()


@pytest.mark.parametrize("loss, eps", [("dpo", 0.0), ("cdpo", 0.1), ("ipo", 0.0)])
def test_dpo_job_equals_hand_computed_loss(tmp_path, tok_model, loss, eps):
    tok, model = tok_model
    cfg = DPOConfig()
    cfg.data.ref_chosen_logps_key, cfg.data.ref_rejected_logps_key = "ref_c", "ref_r"
    pairs = load_preference_examples([write_jsonl(tmp_path / "p.jsonl", ROWS)], cfg.data, tok, "paired")
    beta = 0.5
    job = DPOJob(None, tok.pad_token_id, micro_batch_size=2, loss=loss, beta=beta, label_smoothing=eps)
    got = sum(job.loss(model, m, 3.0)[0].item() for m in job.micro_batches(pairs))
    want = 0.0
    for r in ROWS:
        (pc, nc), (pr, nr) = _hand_logp(model, tok, r["prompt"], r["chosen"]), _hand_logp(model, tok, r["prompt"], r["rejected"])
        rc, rr = r["ref_c"], r["ref_r"]
        if loss == "ipo":  # IPO on length-averaged log-probs: (h - 1/(2 beta))^2
            h = (pc / nc - pr / nr) - (rc / nc - rr / nr)
            want += (h - 1 / (2 * beta)) ** 2
        else:  # -(1-eps) log sigma(beta h) - eps log sigma(-beta h)
            h = (pc - pr) - (rc - rr)
            want += -(1 - eps) * math.log(_sig(beta * h)) - eps * math.log(_sig(-beta * h))
    assert got == pytest.approx(want / 3, rel=1e-5)


def test_weighted_losses_with_sft_and_ld_dpo_equal_hand_computation(tmp_path, tok_model, tiny_model_dir):
    """MPO-style [sigmoid, bco_pair, sft] weighted, on LD-DPO log-probs (tokens past the pair's shorter completion
    weighted by ld_alpha), against a reference model (not precomputed sums: LD-DPO needs its per-token log-probs)."""
    tok, model = tok_model
    ref = load_causal_lm(tiny_model_dir).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.9)
    cfg = DPOConfig()
    pairs = load_preference_examples([write_jsonl(tmp_path / "p.jsonl", ROWS)], cfg.data, tok, "paired")
    beta, alpha, weights = 0.5, 0.3, (0.8, 0.2, 1.0)
    job = DPOJob(Reference(model=ref), tok.pad_token_id, micro_batch_size=3, loss=["sigmoid", "bco_pair", "sft"],
                 beta=beta, loss_weights=list(weights), ld_alpha=alpha)
    (micro,) = job.micro_batches(pairs)
    got = job.loss(model, micro, 3.0)[0].item()

    def token_logps(m, prompt, completion):
        p_text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
        p_ids = tok(p_text, add_special_tokens=False)["input_ids"]
        c_ids = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logp = torch.log_softmax(m(torch.tensor([p_ids + c_ids])).logits[0].double(), -1)
        return [logp[len(p_ids) + j - 1, t].item() for j, t in enumerate(c_ids)]

    want, nll, n_tokens = 0.0, 0.0, 0
    for r in ROWS:
        lp = {(who, k): token_logps(m, r["prompt"], r[k]) for who, m in (("pi", model), ("ref", ref))
              for k in ("chosen", "rejected")}
        shared = min(len(lp["pi", "chosen"]), len(lp["pi", "rejected"]))
        ld = {key: sum(v[:shared]) + alpha * sum(v[shared:]) for key, v in lp.items()}
        r_c, r_r = ld["pi", "chosen"] - ld["ref", "chosen"], ld["pi", "rejected"] - ld["ref", "rejected"]
        sigmoid = -math.log(_sig(beta * (r_c - r_r)))
        bco = -math.log(_sig(beta * r_c)) - math.log(_sig(-beta * r_r))
        want += weights[0] * sigmoid + weights[1] * bco
        nll -= sum(lp["pi", "chosen"])
        n_tokens += len(lp["pi", "chosen"])
    want = want / 3 + weights[2] * nll / n_tokens  # sft: the micro-batch's chosen-token mean NLL
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("loss, alphapo", [("simpo", 0.0), ("cpo", 0.0), ("orpo", 0.0), ("cpo_hinge", 0.0),
                                           ("cpo_ipo", 0.0), ("simpo", 0.4), ("cpo_ipo", 0.4)])
def test_reference_free_job_equals_hand_computed_loss(tmp_path, tok_model, loss, alphapo):
    """SimPO / CPO / ORPO / CPO's hinge and IPO, AlphaPO (TRL's CPOTrainer and ORPOTrainer formulas) with no
    reference: the job's loss over two micro-batches equals the hand computation, NLL terms included (the
    micro-batch's chosen-token mean, as TRL)."""
    tok, model = tok_model
    pairs = load_preference_examples([write_jsonl(tmp_path / "p.jsonl", ROWS)], DPOConfig().data, tok, "paired")
    beta, gamma, alpha, eps = 0.5, 0.3, 0.7, (0.1 if loss in ("simpo", "cpo") else 0.0)
    job = DPOJob(None, tok.pad_token_id, micro_batch_size=2, loss=loss, beta=beta, label_smoothing=eps,
                 simpo_gamma=gamma, cpo_alpha=alpha, alphapo_alpha=alphapo)
    got = sum(job.loss(model, m, 3.0)[0].item() for m in job.micro_batches(pairs))
    reward = (lambda x: (1 - math.exp(-alphapo * x)) / alphapo) if alphapo else (lambda x: x)  # AlphaPO
    want = 0.0
    for start, stop in ((0, 2), (2, 3)):  # the two micro-batches: the NLL term is each one's chosen-token mean
        rows = ROWS[start:stop]
        lps = [(_hand_logp(model, tok, r["prompt"], r["chosen"]), _hand_logp(model, tok, r["prompt"], r["rejected"]))
               for r in rows]
        nll = -sum(pc for (pc, _), _ in lps) / sum(nc for (_, nc), _ in lps)
        for (pc, nc), (pr, nr) in lps:
            a_c, a_r = pc / nc, pr / nr
            if loss == "orpo":  # -beta log sigma(log odds ratio) + NLL
                odds = (a_c - a_r) - (math.log(1 - math.exp(a_c)) - math.log(1 - math.exp(a_r)))
                want += -beta * math.log(_sig(odds)) + nll
                continue
            summed = loss in ("cpo", "cpo_hinge")
            d = reward(pc if summed else a_c) - reward(pr if summed else a_r) - (gamma / beta if loss == "simpo" else 0)
            if loss == "cpo_hinge":
                want += max(0.0, 1 - beta * d)
            elif loss == "cpo_ipo":
                want += (d - 1 / (2 * beta)) ** 2
            else:
                want += -(1 - eps) * math.log(_sig(beta * d)) - eps * math.log(_sig(-beta * d))
            want += alpha * nll if loss != "simpo" else 0.0
    assert got == pytest.approx(want / 3, rel=1e-5)


def test_kto_job_equals_hand_computed_loss(tmp_path, tok_model):
    tok, model = tok_model
    from tiller.models.tiny import build_model

    ref = build_model(tok, "qwen2", n_params=1_000_000, seed=7).eval()  # a different reference
    rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"} for r in ROWS for k in ("chosen", "rejected")]
    cfg = KTOConfig()
    examples = load_preference_examples([write_jsonl(tmp_path / "k.jsonl", rows)], cfg.data, tok, "unpaired")
    beta, w_d, w_u = 0.3, 1.0, 1.5
    job = KTOJob(Reference(model=ref), tok.pad_token_id, micro_batch_size=4, max_length=512, beta=beta,
                 desirable_weight=w_d, undesirable_weight=w_u)
    micros = job.micro_batches(examples)
    job.prepare_step(model, micros)
    got = sum(job.loss(model, m, 6.0)[0].item() for m in micros)
    # z0: mean over i of log pi - log ref on (prompt_i, completion_{i-1}), clamped at 0
    n = len(rows)
    kl = [_hand_logp(model, tok, rows[i]["prompt"], rows[i - 1]["completion"])[0]
          - _hand_logp(ref, tok, rows[i]["prompt"], rows[i - 1]["completion"])[0] for i in range(n)]
    z = max(0.0, sum(kl) / n)
    assert job.kl_baseline.item() == pytest.approx(sum(kl) / n, rel=1e-5, abs=1e-6)
    want = 0.0
    for r in rows:
        ratio = _hand_logp(model, tok, r["prompt"], r["completion"])[0] - _hand_logp(ref, tok, r["prompt"], r["completion"])[0]
        want += w_d * (1 - _sig(beta * (ratio - z))) if r["label"] else w_u * (1 - _sig(beta * (z - ratio)))
    assert got == pytest.approx(want / n, rel=1e-5)


def test_kto_policy_equal_to_reference_worked_number(tmp_path, tok_model):
    # policy == reference: every log-ratio and the KL baseline are 0, so each desirable example costs
    # w_d (1 - sigma(0)) = 0.5 w_d and each undesirable 0.5 w_u; w_d=1, w_u=2, 3 + 3 examples:
    # (3 * 0.5 + 3 * 1.0) / 6 = 0.75
    tok, model = tok_model
    rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"} for r in ROWS for k in ("chosen", "rejected")]
    examples = load_preference_examples([write_jsonl(tmp_path / "k.jsonl", rows)], KTOConfig().data, tok, "unpaired")
    job = KTOJob(Reference(model=model), tok.pad_token_id, 6, 512, beta=0.1, desirable_weight=1.0, undesirable_weight=2.0)
    micros = job.micro_batches(examples)
    job.prepare_step(model, micros)
    assert job.loss(model, micros[0], 6.0)[0].item() == pytest.approx(0.75, abs=1e-6)


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {a} + {a + 3}?", "chosen": f"The answer is {2 * a + 3}.", "rejected": "I do not know."}
            for a in range(n)]


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lora", [False, True])
def test_dpo_widens_the_margin(tiny_model_dir, tmp_path, lora):
    train = write_jsonl(tmp_path / "d.jsonl", _rows(8))
    run = tmp_path / "dpo"
    extra = {"model.lora_rank": 8, "model.lora_alpha": 16, "optim.lr": 3e-3} if lora else {"optim.lr": 1e-3}
    cfg = load_config(job_overrides(tiny_model_dir, train, run, **{
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 4, "algorithm.beta": 0.1,
        "trainer.total_training_steps": 6, "trainer.export_hf": False, **extra}), schema=DPOConfig, validate=validate_job)
    train_dpo(cfg)
    rows = _metrics(run)
    # step 1 sees policy == reference: implicit rewards 0, loss log 2
    assert rows[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert rows[-1]["train/rewards/margins"] > 0.5 and rows[-1]["train/rewards/accuracies"] == 1.0
    assert rows[-1]["train/loss"] < 0.6 * math.log(2)


@pytest.mark.parametrize("loss", ["simpo", "orpo", "cpo_ipo"])
def test_reference_free_losses_train_without_a_reference(tiny_model_dir, tmp_path, monkeypatch, loss):
    """SimPO / ORPO / CPO-IPO with AlphaPO load no reference model, and training separates the chosen from the
    rejected completions."""
    import tiller.trainer.preference as preference

    def no_reference(*args, **kwargs):
        raise AssertionError("a reference-free loss loaded a reference model")

    monkeypatch.setattr(preference, "build_reference", no_reference)
    train = write_jsonl(tmp_path / "d.jsonl", _rows(8))
    run = tmp_path / loss
    cfg = load_config(job_overrides(tiny_model_dir, train, run, **{
        "algorithm.loss": loss, "algorithm.beta": {"simpo": 2.0, "orpo": 0.1}.get(loss, 1.0),
        "optim.lr": 3e-5 if loss == "cpo_ipo" else 1e-3,  # IPO's square overshoots its target at 1e-3 (Adam)
        **({"algorithm.alphapo_alpha": 0.25, "algorithm.cpo_alpha": 0.0} if loss == "cpo_ipo" else {}),
        "data.train_batch_size": 8, "data.micro_batch_size_per_gpu": 4, "trainer.total_training_steps": 6,
        "trainer.export_hf": False}), schema=DPOConfig, validate=validate_job)
    train_dpo(cfg)
    rows = _metrics(run)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert rows[-1]["train/rewards/margins"] > rows[0]["train/rewards/margins"] + 0.05
    assert rows[-1]["train/rewards/accuracies"] == 1.0
    if loss == "cpo_ipo":  # IPO regresses the (AlphaPO) reward margin onto 1 / (2 beta) = 0.5, not without bound
        assert rows[-1]["train/rewards/margins"] == pytest.approx(0.5, abs=0.15)
        assert rows[-1]["train/loss"] < 0.2 * rows[0]["train/loss"]
    if loss == "orpo":  # TRL's ORPO metrics
        assert rows[-1]["train/log_odds_ratio"] > rows[0]["train/log_odds_ratio"] and "train/nll_loss" in rows[-1]


def test_kto_separates_desirable_from_undesirable(tiny_model_dir, tmp_path):
    rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"} for r in _rows(6) for k in ("chosen", "rejected")]
    train = write_jsonl(tmp_path / "k.jsonl", rows)
    run = tmp_path / "kto"
    cfg = load_config(job_overrides(tiny_model_dir, train, run, **{
        "data.train_batch_size": 12, "data.micro_batch_size_per_gpu": 4, "optim.lr": 1e-3,
        "trainer.total_training_steps": 6, "trainer.export_hf": False}), schema=KTOConfig, validate=validate_job)
    last = train_kto(cfg)
    first = _metrics(run)[0]
    assert first["train/loss"] == pytest.approx(0.5, abs=1e-5)  # policy == ref: 1 - sigma(0) each
    assert last["train/rewards/margins"] > 0.5 and last["train/loss"] < 0.45
    assert last["train/rewards/chosen"] > 0 > last["train/rewards/rejected"]


def test_dpo_config_errors():
    from tiller.errors import ConfigError

    base = ["model.partial_pretrain=x", "data.train_files=[a.jsonl]"]
    with pytest.raises(ConfigError, match="cdpo needs algorithm.label_smoothing"):
        load_config(base + ["algorithm.loss=cdpo"], schema=DPOConfig, validate=validate_job)
    with pytest.raises(ConfigError, match="did you mean 'ipo'"):
        load_config(base + ["algorithm.loss=ipoo"], schema=DPOConfig, validate=validate_job)
    with pytest.raises(ConfigError, match="both data.ref_chosen_logps_key"):
        load_config(base + ["data.ref_chosen_logps_key=rc"], schema=DPOConfig, validate=validate_job)
    for keys, needle in [(["algorithm.loss=[sigmoid,bco_pair]", "algorithm.loss_weights=[1.0]"],
                          r"loss_weights=\[1.0\]: one weight >= 0 per loss"),
                         (["algorithm.loss=[sigmoid,sppo_hrd]"], "did you mean 'sppo_hard'"),
                         (["algorithm.loss=exo_pair"], "exo_pair needs algorithm.label_smoothing > 0"),
                         (["algorithm.loss=bco_pair", "algorithm.f_divergence=js_divergence"],
                          "f_divergence=js_divergence: only for"),
                         (["algorithm.loss=aot", "algorithm.use_weighting=true"], "use_weighting .WPO. with aot"),
                         (["algorithm.ld_alpha=0.5", "data.ref_chosen_logps_key=rc", "data.ref_rejected_logps_key=rr"],
                          "ld_alpha needs the reference's per-token log-probs"),
                         (["algorithm.loss=hinge", "algorithm.label_smoothing=0.1"], "label_smoothing applies to"),
                         (["algorithm.loss=orpo", "model.ref_path=r"], "model.ref_path is set but algorithm.loss"),
                         (["algorithm.loss=simpo", "algorithm.use_weighting=true"], "read no reference"),
                         (["algorithm.loss=dpo", "algorithm.simpo_gamma=1.0"], "simpo_gamma=1.0 is read only"),
                         (["algorithm.loss=simpo", "algorithm.cpo_alpha=0.5"], r"\[simpo,sft\]")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(base + keys, schema=DPOConfig, validate=validate_job)
