"""`tiller` command line: one dispatcher, subcommands imported lazily so `tiller --help` is fast.

Every subcommand is a module function `main(argv: list[str]) -> int | None`. A `UserError` raised
anywhere below prints one clear line and exits 2; any other exception keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys

from tiller.entry import run_main  # noqa: F401  (re-exported: `python -m` entry points used it from here)
from tiller import __version__
from tiller.errors import describe_os_error, UserError

# name -> ("module:function", one-line help). Later subsystems add their line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "rl": ("tiller.trainer.main_ppo:main", "RL post-training (PPO, GRPO, RLOO, ...) with verl's config keys"),
    "demo": ("tiller.trainer.demo:main", "built-in demo: tiny model, SFT warm-up, GRPO; shows accuracy before/after"),
    "sft": ("tiller.trainer.sft:main", "supervised fine-tuning"),
    "rm": ("tiller.trainer.rm:main", "pairwise reward-model training"),
    "dpo": ("tiller.trainer.preference:main_dpo", "DPO / IPO / cDPO preference training"),
    "kto": ("tiller.trainer.preference:main_kto", "KTO preference training"),
    "spin": ("tiller.trainer.spin:main", "SPIN self-play fine-tuning: DPO of SFT targets against the model's own "
             "generations"),
    "train-partitioner": ("tiller.trainer.partitioner:main", "fine-tune a pair classifier (same / different) for "
                          "DARLING's partitioner=classifier and tiller eval --diversity"),
    "config": ("tiller.config.cli:main", "show the resolved configuration: tiller config show [key=value ...]"),
    "data": ("tiller.data_cli:main", "prepare datasets: tiller data gsm8k --out DIR"),
    "export": ("tiller.models.checkpoint:export_main", "export a checkpoint as a Hugging Face model dir"),
    "report": ("tiller.tracking.report:main", "plots and a summary table for a run directory"),
    "serve-rm": ("tiller.rewards.server:main", "serve a reward model over HTTP"),
    "retrieval-server": ("tiller.serve.retrieval:main", "Search-R1's retrieval API over a local corpus (search-agent "
                         "RL: verl's SearchTool)"),
    "generate": ("tiller.evaluation.generate:main", "sample n responses per prompt from a prompt file"),
    "eval": ("tiller.evaluation.evaluate:main", "evaluate a model: mean@n, pass@k, maj@k per data source"),
    "serve": ("tiller.serve.cli:main", "OpenAI-compatible HTTP server: tiller serve MODEL_DIR"),
    "openrlhf": ("tiller.openrlhf.cli:main", "run an OpenRLHF command line: tiller openrlhf train_sft|train_rm|"
                 "train_dpo|train_kto|train_ppo_ray [--flags] [--dry-run]"),
    "trl": ("tiller.trl.cli:main", "run a TRL command line: tiller trl sft|dpo|kto|reward|grpo|rloo [TRL's flags] "
            "[--config FILE.yaml]"),
    "env": ("tiller.env_cli:main", "versions, CPU / GPU, GEMM speed and the bf16 decision: paste into bug reports"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: tiller <command> [options] [key=value ...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `tiller <command> --help` for a command's options."]
    return "\n".join(lines)


def _resolve(target: str):
    module_name, func_name = target.split(":")
    module = importlib.import_module(module_name)
    return getattr(module, func_name)


def _show_tiller_log() -> None:
    """tiller's own log lines (logger "tiller.*", INFO and up: e.g. the CPU bf16 decision and its reason, made
    once per process) go to stderr as `tiller: ...`; a program embedding tiller configures logging itself."""
    import logging

    class StderrHandler(logging.StreamHandler):
        """Writes to whatever sys.stderr is at the time (it may be replaced after the handler is made)."""

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, value):
            pass

    log = logging.getLogger("tiller")
    if not log.handlers:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("tiller: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _quiet_transformers() -> None:
    """No transformers progress bars ("Loading weights", "Writing model shards") between tiller's own lines: a
    local model loads in a blink, and in a log a bar is noise. Hub downloads keep theirs (huggingface_hub's)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"tiller {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=3)
        hint = f" (did you mean: {', '.join(close)}?)" if close else ""
        print(f"tiller: error: unknown command {name!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    _show_tiller_log()
    _quiet_transformers()
    try:
        func = _resolve(COMMANDS[name][0])
        code = func(rest)
    except UserError as err:
        print(f"tiller {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tiller {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tiller env | head`: the reader left; no traceback (Python's documented recipe)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as err:  # the machine, not the input: a full disk, a read-only dir, a permission
        print(f"tiller {name}: error: {describe_os_error(err)}", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
