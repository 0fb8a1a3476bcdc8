"""`tiller eval`: sample n responses per validation prompt, score them by data_source, and report
mean@n, pass@k and maj@k per data source (metrics in `tiller.evaluation.metrics`).

    tiller eval actor_rollout_ref.model.path=DIR data.val_files=[test.parquet] \\
        actor_rollout_ref.rollout.val_kwargs.n=8 actor_rollout_ref.rollout.val_kwargs.do_sample=True \\
        actor_rollout_ref.rollout.val_kwargs.temperature=0.7 --out eval.json

The keys are the RL trainer's (verl's): prompts from `data.val_files` (verl schema: `prompt`,
`data_source`, `reward_model.ground_truth`, `extra_info`), sampling from `actor_rollout_ref.rollout.val_kwargs`
(greedy by default), the engine from `rollout.name` / `rollout.dtype`, the reward from `reward_model.*` and
`custom_reward_function.*` (the same reward manager as training), the seed from `trainer.seed`.
A sample is correct when the scorer's `acc` (or, without one, its score) is > 0.5. maj@k votes over the
answers `tiller.evaluation.answers.extract_answer` reads (or the scorer's `pred`).

With `actor_rollout_ref.rollout.multi_turn.enable=True` the samples are multi-turn tool rollouts
(`tiller.rollout.agent`, tools from `multi_turn.tool_config_path` and `multi_turn.function_tool_path`, default
the calculator): prompts are rendered with the tools' schemas (before data.filter_overlong_prompts / truncation),
`rollout.response_length` / `data.max_response_length` bounds the whole conversation and `val_kwargs` sampling
each turn; the scorer sees the full response (tool results included) and the sample's tool rewards in
`extra_info["tool_rewards"]` (as verl's reward managers); the report adds `agent` means of turns, tool calls, tool
errors and the summed tool reward.

With `--diversity` the report adds NoveltyBench's metrics per data source (`tiller.evaluation.metrics`):
`distinct@k` (distinct equivalence classes among a prompt's first k samples) and `utility@k` (patience-discounted
utility where only the first sample of each class counts; `--patience`, default 0.8). The classes come from the
partitioner configured in `reward_model.diversity.*` (`partitioner`: ngram by default, or `classifier` with
`classifier_path=DIR` from `tiller train-partitioner`), built as NoveltyBench does (each sample joins the first
class whose first member it matches: `greedy_partition`), per prompt. The quality of a sample is its reward
score as is (not NoveltyBench's 1..10 scale, which calibrates its own reward model): with a 0/1 correctness
reward, utility@k is the patience-weighted share of samples that are both correct and new. With
`reward_model.diversity.enable=True` that score already has diversity fused in; leave it off to measure quality.
Each sample record gets its `class`.

Writes `--out` (JSON, atomically): {"metrics": {source: {...}}, "model", "data_files", "sampling", "num_tokens",
"wall_s"}; `--samples FILE.jsonl` also writes every sample (prompt, response, score, acc, pred).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace

import numpy as np

from tiller.config import load_config
from tiller.config.args import add_config_args
from tiller.data.files import atomic_write_text
from tiller.data.rl_dataset import build_rl_dataset, write_rows
from tiller.errors import ConfigError
from tiller.evaluation.answers import extract_answer
from tiller.evaluation.metrics import evaluation_metrics
from tiller.evaluation.runner import (
    decode,
    generate_batched,
    policy_from_config,
    sampling_from_rollout,
    show_progress,
)
from tiller.rewards import build_reward_manager, RewardRequest
from tiller.rewards.diversity import build_partitioner
from tiller.rewards.registry import check_ground_truths
from tiller.rollout.agent import AgentRolloutOutput, tool_means, tools_kwargs_of
from tiller.rollout.verl_agent_loop import build_rollout_loop


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiller eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="eval.json", metavar="FILE.json", help="metrics JSON (default eval.json)")
    parser.add_argument("--samples", metavar="FILE.jsonl", help="also write every scored sample here")
    parser.add_argument("--model", metavar="DIR", help="shortcut for actor_rollout_ref.model.path=DIR")
    parser.add_argument("--data", action="append", default=[], metavar="FILE",
                        help="shortcut for data.val_files (repeat for several)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="prompts per engine call (default data.val_batch_size, else 64)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--diversity", action="store_true",
                        help="add NoveltyBench's distinct@k and utility@k (partitioner from reward_model.diversity.*)")
    parser.add_argument("--patience", type=float, default=0.8, help="utility@k's patience p (default 0.8)")
    add_config_args(parser)
    return parser


def image_inputs(items) -> list[dict | None] | None:
    """Per prompt item its image inputs for the engine (None for a text prompt); None when no item has images."""
    inputs = [getattr(it, "multi_modal_inputs", None) for it in items]
    return inputs if any(m is not None for m in inputs) else None


def score_samples(reward_fn, items, texts: list[str], lengths: list[int], n: int,
                  tool_rewards: list[list[float]] | None = None,
                  given_scores: list[float | None] | None = None) -> list[dict]:
    """One record per sample (prompt i's samples at rows i*n .. i*n+n-1) with score, acc and pred.
    `tool_rewards` (multi-turn rollouts): each sample's tool-call rewards, given to the reward function as
    `extra_info["tool_rewards"]` (verl's reward managers do the same). `given_scores`: per sample, a score its agent
    loop computed (verl's `reward_score`; None: the reward function's), as tiller rl uses it."""
    def extra(i: int, j: int) -> dict:
        info = dict(items[i].extra_info)
        if getattr(items[i], "images", None):  # an image prompt's images, as tiller rl hands them (PIL)
            info.setdefault("images", list(items[i].images))
        if tool_rewards is not None:
            info["tool_rewards"] = list(tool_rewards[i * n + j])
        return info

    requests = [RewardRequest(data_source=it.data_source, prompt=it.prompt_text, response=texts[i * n + j],
                              ground_truth=it.ground_truth, extra_info=extra(i, j),
                              response_length=lengths[i * n + j], group=str(i))
                for i, it in enumerate(items) for j in range(n)]
    result = reward_fn(requests)
    scores = np.asarray(result.scores, dtype=np.float64)
    accs = np.asarray(result.extras.get("acc", scores), dtype=np.float64)
    for b, given in enumerate(given_scores or []):
        if given is not None:
            scores[b] = accs[b] = float(given)
    preds = result.extras.get("pred")
    records = []
    for b, req in enumerate(requests):
        pred = preds[b] if preds is not None else extract_answer(req.data_source, req.response)
        records.append({"data_source": req.data_source, "prompt_index": b // n, "sample_index": b % n,
                        "score": float(scores[b]), "acc": float(accs[b] > 0.5),
                        "pred": None if pred is None or pred == "[INVALID]" else str(pred),
                        "prompt": req.prompt, "response": req.response, "ground_truth": _jsonable(req.ground_truth)})
    return records


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def format_table(metrics: dict[str, dict[str, float]]) -> str:
    """A plain-text table: one row per data source, one column per metric."""
    cols: list[str] = []
    for m in metrics.values():
        cols += [k for k in m if k not in cols and k != "n"]
    header = ["data_source", *cols]
    body = [[src] + [f"{m[c]:.0f}" if c == "num_prompts" else (f"{m[c]:.4f}" if c in m else "-") for c in cols]
            for src, m in metrics.items()]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def assign_classes(records: list[dict], partitioner) -> None:
    """Set each record's `class`: the greedy (NoveltyBench) partition of its prompt's responses, in sample order."""
    prompts: dict = {}
    for r in records:
        prompts.setdefault((r["data_source"], r["prompt_index"]), []).append(r)
    for group in prompts.values():
        group.sort(key=lambda r: r["sample_index"])
        for r, label in zip(group, partitioner.greedy_partition([r["response"] for r in group])):
            r["class"] = label


def run_eval(cfg, *, batch_size: int | None = None, progress: bool = True, diversity: bool = False,
             patience: float = 0.8) -> tuple[dict, list[dict]]:
    """Generate and score `cfg.data.val_files`; returns (report dict, per-sample records)."""
    if not cfg.data.val_files:
        raise ConfigError("tiller eval needs data.val_files=[FILE, ...] (or --data FILE)")
    if not 0.0 < patience <= 1.0:
        raise ConfigError(f"--patience={patience}: utility@k's patience lies in (0, 1]")
    r = cfg.actor_rollout_ref.rollout
    if r.agent.path or r.agent.env_path:
        raise ConfigError("tiller eval runs single-turn prompts, verl's multi-turn tool loop (multi_turn.enable) and "
                          "verl agent loops (agent.agent_loop_config_path); an agent function or environment "
                          "(actor_rollout_ref.rollout.agent.path / env_path) is evaluated by tiller rl's validation "
                          "(trainer.val_only=true)")
    # (its settings checked before the model loads; verl's custom agent loops read each row's chat messages)
    agent = build_rollout_loop(r, cfg.data.apply_chat_template_kwargs, config=cfg)
    if r.agent.agent_loop_config_path and not cfg.data.return_raw_chat:
        cfg = replace(cfg, data=replace(cfg.data, return_raw_chat=True))
    policy = policy_from_config(cfg)
    partitioner = None
    if diversity:  # built before generating, so a bad partitioner key fails fast
        partitioner = build_partitioner(cfg.reward_model.diversity, policy.tokenizer)
    # the tools' schemas in the prompts (filtered by length with them)
    schemas = [t.schema for t in agent.tools.values()] if agent is not None and agent.tools is not None else None
    items = build_rl_dataset(cfg.data, policy.tokenizer, cfg.data.val_files, max_samples=cfg.data.val_max_samples,
                             what="data.val_files", tool_schemas=schemas, processor=policy.processor,
                             agent_names=agent.agent_names() if hasattr(agent, "agent_names") else ()).items
    rm = cfg.reward_model
    if not (cfg.custom_reward_function.path or rm.enable or rm.remote_url):  # rule scoring: types must fit
        check_ground_truths(items, "data.val_files", rm.bad_ground_truth)
    sampling = sampling_from_rollout(r, r.response_length or cfg.data.max_response_length,
                                     cfg.trainer.seed, val=True)
    start = time.time()
    size = batch_size or cfg.data.val_batch_size or 64
    if agent is None:
        out = generate_batched(policy.engine, [it.prompt_ids for it in items], sampling, batch_size=size,
                               progress=progress, desc="eval", multi_modal=image_inputs(items))
    else:
        out = _agent_generate(agent, policy, items, sampling, cfg, size, progress)
    gen_s = time.time() - start
    texts = [decode(policy.tokenizer, ids) for ids in out.response_ids]
    reward_fn = build_reward_manager(cfg, policy.tokenizer)
    try:
        records = score_samples(reward_fn, items, texts, [len(ids) for ids in out.response_ids], sampling.n,
                                tool_rewards=getattr(out, "tool_rewards", None),
                                given_scores=[getattr(s, "reward_score", None) for s in getattr(out, "states", [])])
    finally:
        if hasattr(reward_fn, "close"):
            reward_fn.close()
    if partitioner is not None:
        assign_classes(records, partitioner)
    report = {
        "metrics": evaluation_metrics(records, seed=cfg.trainer.seed, patience=patience),
        "model": cfg.actor_rollout_ref.model.path,
        "data_files": list(cfg.data.val_files),
        "sampling": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(sampling).items()},
        "num_tokens": out.num_tokens,
        "generate_s": gen_s,
        "wall_s": time.time() - start,
    }
    if partitioner is not None:
        report["diversity"] = {"partitioner": cfg.reward_model.diversity.partitioner, "patience": patience,
                               "quality": "reward score", "classifier_path": cfg.reward_model.diversity.classifier_path}
    if agent is not None:
        report["agent"] = tool_means(out.num_turns, out.num_tool_calls, out.tool_errors, out.tool_rewards)
    return report, records


def _agent_generate(agent, policy, items, sampling, cfg, batch_size: int, progress: bool):
    """Multi-turn tool rollouts for the eval prompts (rendered with the tools' schemas by the dataset), in batches."""
    from tqdm.auto import tqdm

    d, tok = cfg.data, policy.tokenizer
    prompts = [it.prompt_ids for it in items]
    out = AgentRolloutOutput()
    budget = cfg.actor_rollout_ref.rollout.response_length or d.max_response_length
    for j, start in enumerate(tqdm(range(0, len(prompts), batch_size), desc="eval (tools)",
                                      disable=not show_progress(progress))):
        call = replace(sampling, seed=None if sampling.seed is None else sampling.seed + j)
        images = image_inputs(items[start:start + batch_size])
        chunk = items[start:start + batch_size]
        more = {}
        if getattr(agent, "wants_rows", False):  # verl agent loops: each row's fields, as tiller rl hands them
            more["rows"] = [{"raw_prompt": it.raw_prompt, "data_source": it.data_source,
                             "ground_truth": it.ground_truth, "extra_info": it.extra_info,
                             "agent_name": it.agent_name, "uid": f"eval-{start + i}"} for i, it in enumerate(chunk)]
        else:
            more["single_turn"] = [getattr(it, "agent_name", None) == "single_turn_agent" for it in chunk]
        res = agent.generate(policy.engine, tok, prompts[start:start + batch_size], call, max_response_length=budget,
                             tools_kwargs=[tools_kwargs_of(it.extra_info) for it in chunk], multi_modal=images, **more)
        for name in ("prompt_ids", "response_ids", "logprobs", "finish_reason", "response_mask", "num_turns",
                     "num_tool_calls", "tool_errors", "tool_rewards"):
            getattr(out, name).extend(getattr(res, name))
        out.states.extend(res.states or [None] * len(res.response_ids))
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"actor_rollout_ref.model.path={args.model}")
    if args.data:
        overrides.append(f"data.val_files=[{','.join(args.data)}]")
    cfg = load_config(overrides, config_file=args.config, preset=args.preset)
    report, records = run_eval(cfg, batch_size=args.batch_size, progress=not args.no_progress,
                               diversity=args.diversity, patience=args.patience)
    print(format_table(report["metrics"]))
    path = atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    if args.samples:
        write_rows(records, args.samples)
    print(f"wrote {path} ({report['num_tokens']} tokens generated in {report['generate_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    from tiller.entry import run_main

    run_main(main)
