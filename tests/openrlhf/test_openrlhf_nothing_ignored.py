"""Nothing is ignored silently: for every option of every job (flat, dotted and FSDP), given with a value other than
OpenRLHF's default, the translation changes the resolved config, prints a notice, or stops with a clear error."""

from __future__ import annotations

import pytest

from tiller.errors import UserError
from tiller.openrlhf import spec
from tiller.openrlhf.parse import flag_index, parse_command
from tiller.openrlhf.translate import translate
from tiller.openrlhf.table import HINT, MAPPED, REFUSED

BASE = {
    ("flat", "train_sft"): ["--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a"],
    ("flat", "train_rm"): ["--pretrain", "m", "--dataset", "d.jsonl"],
    ("flat", "train_dpo"): ["--pretrain", "m", "--dataset", "d.jsonl"],
    ("flat", "train_kto"): ["--pretrain", "m", "--dataset", "d.jsonl", "--output_key", "a"],
    ("flat", "train_ppo_ray"): ["--pretrain", "m", "--remote_rm_url", "http://x/get_reward", "--prompt_data", "p.jsonl",
                                "--n_samples_per_prompt", "2", "--eval_dataset", "e.jsonl", "--eval_steps", "2"],
    ("dotted", "train_sft"): ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl", "--data.output_key", "a"],
    ("dotted", "train_rm"): ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"],
    ("dotted", "train_dpo"): ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"],
    ("dotted", "train_ppo_ray"): ["--actor.model_name_or_path", "m", "--reward.remote_url", "http://x/get_reward",
                                  "--data.prompt_dataset", "p.jsonl", "--rollout.n_samples_per_prompt", "2",
                                  "--eval.dataset", "e.jsonl", "--eval.steps", "2"],
}
BASE.update({("fsdp", job): [*argv, "--fsdp.param_dtype", "bf16"] for (version, job), argv in list(BASE.items())
             if version == "dotted"})  # one --fsdp.* flag selects the FSDP2 backend's option set
# a value other than the default where a generic one does not fit
SPECIAL = {
    "input_key": ["q"], "output_key": ["b"], "label_key": ["lab"], "prompt_key": ["p"], "chosen_key": ["c"],
    "rejected_key": ["r"], "input_template": ["Q: {} A:"], "dataset": ["other.jsonl"], "prompt_data": ["o.jsonl"],
    "dataset_probs": ["1.0"], "prompt_data_probs": ["1.0"], "eval_dataset": ["f.jsonl"], "pretrain": ["other"],
    "reward_pretrain": ["rm"], "remote_rm_url": ["r.py"], "critic_pretrain": ["crit"], "ref_pretrain": ["ref"],
    "lr_scheduler": ["cosine"], "critic.lr_scheduler": ["cosine"], "loss": ["logexp"],
    "advantage_estimator": ["rloo"], "kl_estimator": ["k2"], "policy_loss_type": ["gspo"], "target_modules": ["q_proj"],
    "wandb_run_name": ["run1"], "ds.param_dtype": ["fp16"], "fsdp.attn_implementation": ["sdpa"], "optim": ["muon"],
    "algo.advantage.is_correction_type": ["icepop"], "train_batch_size": ["64"], "micro_train_batch_size": ["2"],
    "rollout_batch_size": ["16"], "n_samples_per_prompt": ["4"], "eps_clip_low_high": ["0.2", "0.3"],
    "dynamic_filtering_reward_range": ["0", "0.5"], "reward_clip_range": ["-3", "3"], "adam_betas": ["0.9", "0.99"],
    "critic.adam.betas": ["0.9", "0.99"], "algo.advantage.is_correction_threshold": ["0.4", "4"],
    "max_len": ["1024"], "prompt_max_len": ["512"], "generate_max_len": ["256"], "eval_split": ["dev"],
    "dataset_split": ["dev"], "prompt_split": ["dev"], "save_path": ["./elsewhere"], "ckpt_path": ["./c"],
    "overlong_buffer_len": ["8"], "use_tensorboard": ["tb"], "tokenizer_chat_template": ["{{x}}"],
    "agent_func_path": ["agent.py"], "grad_accum_dtype": ["fp32"], "vllm_sync_backend": ["gloo"],
    "ds.attn_implementation": ["sdpa"], "ds.experts_implementation": ["eager"], "ckpt.best_metric_key": ["acc"],
    "kl_target": ["0.1"], "dual_clip": ["3"], "entropy_loss_coef": ["0.01"], "wandb_org": ["org"],
    "wandb_group": ["grp"], "use_wandb": ["True"], "data.image_key": ["img"], "learning_rate": ["3e-5"],
}


def _value(name: str, row: str, dest_default, action, nargs, type_name) -> list[str]:
    if name in SPECIAL or row in SPECIAL:
        return SPECIAL.get(name, SPECIAL.get(row))
    if action in ("StoreTrue", "StoreFalse"):
        return []
    if nargs == 2:
        return [str(float(v) + 1) for v in dest_default] if dest_default else ["0.1", "0.2"]
    if type_name == "int":
        return [str(int(dest_default or 0) + 2)] if dest_default != -1 else ["5"]
    if type_name == "float":
        return [str(float(dest_default or 0.05) * 0.5)] if dest_default != "inf" else ["1000"]
    return ["x"]


def cases():
    index = flag_index()
    out = []
    for version, table in (("flat", spec.FLAT), ("dotted", spec.DOTTED), ("fsdp", spec.FSDP)):
        for job, opts in table.items():
            for names, _dest, action, nargs, type_name, default, _choices in opts:
                name = names[0][2:]
                row = index[name]
                if action == "StoreTrue" and default is True:
                    continue  # given = its default (muon.nesterov): nothing to change
                if version == "fsdp" and names in {n for n, *_ in spec.DOTTED[job]}:
                    continue  # the same option as in the dotted set (checked there)
                out.append(pytest.param(version, job, names[0], row.name, row.for_job(job)[0],
                                        _value(name, row.name, default, action, nargs, type_name),
                                        id=f"{version}-{job}-{name}"))
    return out


def _resolve(argv):
    """(translated values + environment, notices, error): the translation, without building the config."""
    try:
        tr = translate(parse_command(argv))
    except UserError as err:
        return None, None, str(err)
    values = dict(tr.values, **{f"env:{k}": v for k, v in tr.env.items()})
    return values, tr.notices, None


@pytest.mark.parametrize("version, job, option, row, kind, value", cases())
def test_option_is_honoured_noticed_or_refused(version, job, option, row, kind, value):
    base = [job, *BASE[(version, job)]]
    before, notices_before, err = _resolve(base)
    assert err is None, err
    base_wo = [t for i, t in enumerate(base) if not (t == option or (i and base[i - 1] == option))]
    if option in base:  # an option of the base line: change its value in place
        argv = base_wo + [option, *value]
    else:
        argv = base + [option, *value]
    after, notices, err = _resolve(argv)
    if kind == REFUSED:
        assert err is not None and option in err and "refused" in err, (option, err)
        return
    if err is not None:  # a mapped value tiller cannot honour: a clear error naming the option
        assert option in err or row in err, (option, err)
        return
    if row != "wandb_run_name":  # the default run name is a time stamp: two resolves may straddle a second
        before.pop("trainer.experiment_name"), after.pop("trainer.experiment_name")
    if kind == HINT:
        assert len(notices) == len(notices_before) + 1 and any(n.startswith(option) for n in notices), notices
        assert after == before, "a hint changed the config"
        return
    assert kind == MAPPED
    if row == "wandb_run_name":
        assert after["trainer.experiment_name"] == value[0]
        return
    assert after != before or len(notices) == len(notices_before) + 1, \
        f"{option} {' '.join(value)}: mapped but the translation did not change and no notice"
