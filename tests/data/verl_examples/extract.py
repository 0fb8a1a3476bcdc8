"""Regenerate the override lists in this directory from a verl checkout (a dev tool; the tests only read the JSON).

    python tests/data/verl_examples/extract.py VERL_GIT_DIR COMMIT [script ...]
    python tests/data/verl_examples/extract.py --tree VERL_GIT_DIR COMMIT TAG   # the two generated config trees
    python tests/data/verl_examples/extract.py --out verl010 VERL_GIT_DIR COMMIT examples/.../*.sh  # a subdirectory

With --out the files are named <examples dir>__<script>.json (script names repeat across verl's example dirs); each
records the trainer's entry point as "main".

`--tree` writes `TAG_generated_ppo_trainer.tsv` / `TAG_generated_ppo_megatron_trainer.tsv`: every key path of verl's
`verl/trainer/config/_generated_*.yaml` with its default (JSON), tab-separated (an empty mapping is one key).

Each launch script is run by bash with `python`, `python3`, `srun`, `ray`, `conda`, `nvidia-smi`, ... replaced by
stubs on PATH: the `python -m verl.trainer.main_ppo` (or a recipe's main) call records its arguments and nothing
runs. Hydra's `--config-path/--config-name` are kept apart; paths (data files, models, run dirs) are replaced by
tiny local names, the only change made to what the script passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
STUB_PY = r'''#!/bin/bash
if [ "$1" = "-m" ] && [[ "$2" == verl.trainer.main_* || "$2" == recipe.*main* || "$2" == verl.experimental.*main* ]]; then
  printf '%s\0' "$2" >> "$CAPTURE"; shift 2; for a in "$@"; do printf '%s\0' "$a" >> "$CAPTURE"; done
  printf '\1' >> "$CAPTURE"; fi
exit 0
'''
STUB_SRUN = r'''#!/bin/bash
while [ $# -gt 0 ]; do case "$1" in python|python3) exec "$@";; *) shift;; esac; done
'''
PATH_KEYS = {"data.train_files": "data/train.parquet", "data.val_files": "data/test.parquet",
             "actor_rollout_ref.model.path": "tiny-model", "critic.model.path": "tiny-model",
             "reward_model.model.path": "tiny-rm", "reward.reward_model.model_path": "tiny-rm",
             "trainer.default_local_dir": "runs/example", "data.tokenizer": "tiny-model",
             "actor_rollout_ref.model.tokenizer_path": "tiny-model", "critic.model.tokenizer_path": "tiny-model",
             "reward_model.model.input_tokenizer": "tiny-model", "custom_reward_function.path": "reward.py",
             "actor_rollout_ref.rollout.multi_turn.tool_config_path": "tools.yaml"}


def _local(item: str) -> str:
    key, eq, value = item.partition("=")
    bare = key.lstrip("+~")
    if eq and bare in PATH_KEYS:
        return f"{key}={PATH_KEYS[bare]}"
    return item


def extract(repo: Path, commit: str, script: str) -> dict:
    text = subprocess.run(["git", f"--git-dir={repo}", "show", f"{commit}:{script}"], check=True,
                          capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp, "bin")
        bin_dir.mkdir()
        for name, body in (("python", STUB_PY), ("python3", STUB_PY), ("srun", STUB_SRUN), ("ray", STUB_SRUN),
                           ("uv", STUB_SRUN)):
            (bin_dir / name).write_text(body)
        for name in ("conda", "nvidia-smi", "scontrol", "sleep", "huggingface-cli", "hf", "wget", "hostname",
                     "pip", "pip3", "modelscope", "hdfs", "mkdir", "tee", "nproc"):
            (bin_dir / name).write_text("#!/bin/bash\nexit 0\n")
        for f in bin_dir.iterdir():
            f.chmod(0o755)
        Path(tmp, "script.sh").write_text("ulimit() { :; }\n" + text)  # (raising limits is not permitted here)
        capture = Path(tmp, "capture")
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/home/user", "CAPTURE": str(capture),
               "SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_PER_NODE": "8", "NNODES": "1", "NGPUS_PER_NODE": "8",
               # variables some scripts require (`${X:?}`, set -u); their paths are replaced below like the others
               "HDFS_ROOT": "/hdfs", "DATA_ROOT": "/data", "RAY_DATA_HOME": "/home/user/verl", "INFER_BACKEND": "vllm",
               "MODEL_PATH": "tiny-model", "LORA_ADAPTER_PATH": "/path/lora_adapter"}
        run = subprocess.run(["bash", "script.sh"], cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=60, text=True)
        calls = [c for c in capture.read_bytes().split(b"\1") if c] if capture.exists() else []
    if not calls:
        raise SystemExit(f"{script}: no trainer call captured: {run.stderr.strip().splitlines()[-1:]}")
    main, *args = [a.decode() for a in calls[0].split(b"\0") if a]
    config, overrides, i = {}, [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--config-"):
            name, eq, value = a.partition("=")
            if not eq:
                value, i = args[i + 1], i + 1
            config[name.lstrip("-")] = value
        elif a.strip():
            overrides.append(_local(a))
        i += 1
    return {"repo": Path(repo).parent.name.replace("+", "/"), "commit": commit, "file": script, "main": main,
            "config": config, "overrides": overrides}


def _flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def trees(repo: Path, commit: str, tag: str) -> None:
    import yaml

    def git(*args: str) -> str:
        return subprocess.run(["git", f"--git-dir={repo}", *args], check=True, capture_output=True, text=True).stdout

    date, version = git("log", "-1", "--format=%cs", commit).strip(), git("show", f"{commit}:verl/version/version").strip()
    for name in ("_generated_ppo_trainer", "_generated_ppo_megatron_trainer"):
        flat = _flat(yaml.safe_load(git("show", f"{commit}:verl/trainer/config/{name}.yaml")))
        lines = [f"# every key path of verl/trainer/config/{name}.yaml with its default (JSON), tab-separated",
                 f"# {Path(repo).parent.name.replace('+', '/')} {commit} ({date}, version {version})"]
        lines += [f"{k}\t{json.dumps(v)}" for k, v in flat.items()]
        (HERE / f"{tag}{name}.tsv").write_text("\n".join(lines) + "\n")
        print(f"{tag}{name}.tsv: {len(flat)} keys")


def main(argv: list[str]) -> None:
    if argv[0] == "--tree":
        trees(Path(argv[1]), argv[2], argv[3])
        return
    out_dir = HERE
    if argv[0] == "--out":  # a subdirectory (verl010/): scripts of another verl commit keep their own names
        out_dir, argv = HERE / argv[1], argv[2:]
        out_dir.mkdir(exist_ok=True)
    repo, commit, *scripts = argv
    for script in scripts:
        try:
            out = extract(Path(repo), commit, script)
        except SystemExit as err:
            print(err)
            continue
        name = Path(script).with_suffix(".json").name
        if out_dir != HERE:  # examples/<dir>/.../<script>.sh -> <dir>__<script>.json (names repeat across dirs)
            name = f"{Path(script).parts[1]}__{name}"
        if Path(repo).parent.name.endswith("verl-recipe"):
            name = "recipe_" + name
        (out_dir / name).write_text(json.dumps(out, indent=1) + "\n")
        print(f"{name}: {len(out['overrides'])} overrides")


if __name__ == "__main__":
    main(sys.argv[1:])
