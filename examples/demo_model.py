"""The demo's trained model outside tiller: score it through `tiller serve` with the `openai` client, or with
plain transformers on the exported model dir. Both print the greedy accuracy on a prompt file, the number
`tiller demo` printed ("after RL") when given the demo's held-out prompts (`runs/demo/data/test.parquet`).

    tiller export runs/demo --to demo-model
    tiller serve demo-model --port 8000 &
    python examples/demo_model.py openai --base-url http://127.0.0.1:8000/v1 --data runs/demo/data/test.parquet
    python examples/demo_model.py transformers --model demo-model --data runs/demo/data/test.parquet

Each prompt is one chat call (`temperature=0`, up to 6 new tokens, as the demo validates): the model's tokenizer
carries the template it was trained with, so the chat API and `apply_chat_template` prompt it as RL did.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from tiller.data.rl_dataset import read_rows
from tiller.rewards import default_compute_score

MAX_NEW_TOKENS = 6


def _messages(row: dict) -> list[dict]:
    prompt = row["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def answers_openai(base_url: str, rows: list[dict], clients: int = 8) -> list[str]:
    """One greedy chat completion per row from an OpenAI-compatible server (e.g. `tiller serve`)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id  # the one model the server serves

    def ask(row: dict) -> str:
        reply = client.chat.completions.create(model=model, messages=_messages(row), temperature=0.0,
                                               max_tokens=MAX_NEW_TOKENS)
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(ask, rows))


def answers_transformers(model_dir: str, rows: list[dict]) -> list[str]:
    """One greedy `generate` per row with transformers alone (`apply_chat_template`, then decode)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(_messages(row), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def accuracy(rows: list[dict], answers: list[str]) -> float:
    """Share of rows whose answer the row's scorer (by `data_source`) counts as right."""
    scores = []
    for row, text in zip(rows, answers):
        score = default_compute_score(row["data_source"], text, row["reward_model"]["ground_truth"],
                                      row.get("extra_info") or {})
        scores.append(float(score["score"] if isinstance(score, dict) else score))
    return sum(s > 0.5 for s in scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("via", choices=["openai", "transformers"])
    parser.add_argument("--data", required=True, help="prompt file (verl schema), e.g. runs/demo/data/test.parquet")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="openai: the server's /v1 URL")
    parser.add_argument("--model", default=None, help="transformers: the exported model dir")
    parser.add_argument("--limit", type=int, default=None, help="only the file's first N prompts")
    args = parser.parse_args(argv)
    rows = read_rows(args.data)[:args.limit]
    if args.via == "openai":
        answers = answers_openai(args.base_url, rows)
    else:
        if not args.model:
            parser.error("transformers needs --model DIR (the exported model)")
        answers = answers_transformers(args.model, rows)
    acc = accuracy(rows, answers)
    print(json.dumps({"via": args.via, "prompts": len(rows), "greedy_accuracy": round(acc, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
