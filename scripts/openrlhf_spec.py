"""Regenerate `tiller/openrlhf/spec.py`: OpenRLHF's argparse options read from its source.

    git clone https://github.com/OpenRLHF/OpenRLHF && cd OpenRLHF
    python /path/to/tiller/scripts/openrlhf_spec.py > /path/to/tiller/tiller/openrlhf/spec.py

Each `parser.add_argument(...)` call of `openrlhf/cli/train_{sft,rm,dpo,kto,ppo_ray}.py` is rebuilt on a real
argparse parser (ast, no OpenRLHF import), at tag v0.8.9.post1 (flat names, the last release with train_kto)
and at v0.11.0 (dotted names; also OpenRLHF's main as of 2026-08-13, 3c3be623), and at the FSDP2 / AutoModel
backend's `--fsdp.*` option set of the unmerged `automodel` branch (commit c37c32d7, 2026-05-02: `--ds.*` replaced
by `--fsdp.*`); names, dest, action, nargs, type, default and choices are written out.
"""
import argparse, ast, json, subprocess, sys

def options(src):
    tree = ast.parse(src)
    parser = argparse.ArgumentParser(allow_abbrev=True)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            code = ast.unparse(node)
            code = code.replace(code.split(".add_argument")[0] + ".add_argument", "parser.add_argument", 1)
            if "{prefix}" in code:
                for prefix in ("actor", "critic"):
                    act = eval(code, {"parser": parser, "prefix": prefix, "int": int, "float": float, "str": str})
                    kind = type(act).__name__
                    out.append(dict(names=act.option_strings, dest=act.dest, default=act.default, nargs=act.nargs, action=kind,
                            type=getattr(act.type, "__name__", None), choices=list(act.choices) if act.choices else None, help=act.help))
                continue
            try:
                act = eval(code, {"parser": parser, "int": int, "float": float, "str": str, "os": __import__("os"), "datetime": __import__("datetime").datetime, "bool": bool, "json": json})
            except argparse.ArgumentError:
                continue
            except Exception as e:
                print("FAIL", code, e, file=sys.stderr); continue
            if not act.option_strings: continue
            kind = type(act).__name__
            out.append(dict(names=act.option_strings, dest=act.dest, default=act.default if not callable(act.default) else repr(act.default), nargs=act.nargs, action=kind,
                            type=getattr(act.type, "__name__", None), choices=list(act.choices) if act.choices else None, help=act.help))
    return out

def dump(tag):
  res = {}
  for job in ["train_sft", "train_rm", "train_dpo", "train_kto", "train_ppo_ray"]:
    try:
        src = subprocess.run(["git", "show", f"{tag}:openrlhf/cli/{job}.py"], capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError:
        continue
    res[job] = options(src)
  return res


FSDP_COMMIT = "c37c32d72446cb4d3ec4fb23d2277a5dc45d8c7f"  # OpenRLHF branch `automodel`: the FSDP2 backend


RUN_NAME = {"train_sft": "sft_%m%dT%H:%M", "train_rm": "rm_%m%dT%H:%M", "train_dpo": "exp_%m%dT%H:%M",
            "train_kto": "rm_%m%dT%H:%M", "train_ppo_ray": "ppo_%m%dT%H:%M"}


def row(job, o):
    default = o["default"]
    if o["dest"].endswith("run_name"):
        default = RUN_NAME[job]  # a datetime.now() string in OpenRLHF
    if isinstance(default, tuple):
        default = list(default)
    if isinstance(default, float) and default == float("inf"):
        default = "inf"
    return (tuple(o["names"]), o["dest"], o["action"].strip("_").replace("Action", "") or "Store", o["nargs"],
            o["type"], default, tuple(o["choices"]) if o["choices"] else None)


if __name__ == "__main__":
    print('"""OpenRLHF\'s command-line options, read from its source by `scripts/openrlhf_spec.py` (do not edit).')
    print()
    print("Per version and job: (option strings, dest, action, nargs, type, default, choices).")
    print('"""')
    print()
    print("# fmt: off")
    for var, tag in (("FLAT", "v0.8.9.post1"), ("DOTTED", "v0.11.0"), ("FSDP", FSDP_COMMIT)):
        print(f"{var}_TAG = {tag!r}")
        print(f"{var} = {{")
        for job, opts in dump(tag).items():
            print(f"    {job!r}: [")
            for o in opts:
                print(f"        {row(job, o)!r},")
            print("    ],")
        print("}")
