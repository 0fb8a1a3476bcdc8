"""The flag table of `tiller openrlhf`: every OpenRLHF flag of the five CLIs is classified, once.

`data/openrlhf-0.8.9-cli-flags.md` is the fact sheet read from OpenRLHF v0.8.9.post1's five CLI files (flag, jobs,
default); `tiller.openrlhf.spec` is generated from OpenRLHF's source (flat v0.8.9.post1, dotted v0.11.0).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tiller.openrlhf import spec
from tiller.openrlhf.table import HINT, JOB_LETTER, MAPPED, REFUSED, TABLE

FACT_SHEET = Path(__file__).parent / "data" / "openrlhf-0.8.9-cli-flags.md"
LETTER_JOB = {v: k for k, v in JOB_LETTER.items()}


def fact_sheet() -> dict[str, set[str]]:
    """job -> flag names (no dashes) listed in the fact sheet."""
    out: dict[str, set[str]] = {job: set() for job in JOB_LETTER}
    for line in FACT_SHEET.read_text().splitlines():
        m = re.match(r"\| `--([a-z0-9_]+)` \| ([SRDKP]+) \|", line)
        if m:
            for letter in m.group(2):
                out[LETTER_JOB[letter]].add(m.group(1))
    return out


def _index():
    out = {}
    for row in TABLE:
        for name in (row.name, *row.dotted):
            assert out.get(name, row) is row, f"{name} has two rows"
            out[name] = row
    return out


def test_fact_sheet_matches_the_generated_spec():
    sheet = fact_sheet()
    # the fact sheet's own counts: sft 68, rm 69, dpo 72, kto 63, ppo_ray 136; 160 distinct names
    assert {job: len(flags) for job, flags in sheet.items()} == {
        "train_sft": 68, "train_rm": 69, "train_dpo": 72, "train_kto": 63, "train_ppo_ray": 136}
    assert len(set().union(*sheet.values())) == 160
    for job, flags in sheet.items():
        assert {names[0][2:] for names, *_ in spec.FLAT[job]} == flags, job


@pytest.mark.parametrize("job", list(JOB_LETTER))
def test_every_fact_sheet_flag_is_classified(job):
    index = _index()
    for flag in sorted(fact_sheet()[job]):
        assert flag in index, f"{job}: --{flag} has no row in tiller.openrlhf.table"
        kind, text = index[flag].for_job(job)
        assert kind in (MAPPED, HINT, REFUSED) and len(text) >= 5, (job, flag)


def test_every_option_of_every_version_has_exactly_one_row():
    index = _index()
    used = set()
    for version in (spec.FLAT, spec.DOTTED, spec.FSDP):
        for job, opts in version.items():
            for names, *_ in opts:
                assert len(names) == 1
                assert names[0][2:] in index, f"{job}: {names[0]} is not classified"
                used.add(index[names[0][2:]].name)
    assert used == {row.name for row in TABLE}, "a table row matches no OpenRLHF option"
    assert set(spec.DOTTED) == set(spec.FSDP) == set(JOB_LETTER) - {"train_kto"}  # 0.10+ dropped train_kto


def test_table_examples_from_the_issue():
    index = _index()
    assert index["ds.zero_stage"] is index["zero_stage"]
    assert index["zero_stage"].for_job("train_ppo_ray")[0] == HINT  # offline jobs: mapped to trainer.strategy
    assert index["zero_stage"].for_job("train_sft")[0] == MAPPED
    assert index["flash_attn"].kind == HINT
    for flag in ("vllm_sync_backend", "actor_num_gpus_per_node", "adam_offload", "deepspeed_enable_sleep"):
        assert index[flag].kind == HINT, flag
    for flag in ("train_batch_size", "rollout_batch_size", "init_kl_coef", "remote_rm_url", "normalize_reward",
                 "n_samples_per_prompt", "packing_samples", "input_template", "label_key"):
        assert index[flag].kind == MAPPED, flag
    assert index["algo.advantage.estimator"] is index["advantage_estimator"]
    assert index["train.batch_size"] is index["train_batch_size"]
    assert index["load_in_4bit"].kind == MAPPED and index["pretrain_mode"].kind == REFUSED


def counts() -> dict[str, dict[str, int]]:
    """job -> {class: number of distinct table rows its options (flat and dotted) fall in}."""
    index = _index()
    out = {}
    for job in JOB_LETTER:
        rows = {index[names[0][2:]].name: index[names[0][2:]]
                for version in (spec.FLAT, spec.DOTTED, spec.FSDP) for names, *_ in version.get(job, [])}
        out[job] = {k: sum(1 for r in rows.values() if r.for_job(job)[0] == k) for k in (MAPPED, HINT, REFUSED)}
    return out


def test_counts_are_what_help_prints(capsys):
    from tiller.openrlhf.cli import main

    for job, c in counts().items():
        assert main([job, "--help"]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert f"({c[MAPPED]} mapped, {c[HINT]} hints, {c[REFUSED]} refused)" in head, (job, head)
