"""Load a typed config: defaults <- preset / --config FILE.yaml <- dotted command-line overrides.

Built on omegaconf structured configs, with Hydra's grammar (what verl's command lines are written in):
- a YAML file is composed with `hydra.compose`, so its `defaults:` list works as in verl (other YAMLs of
  its directory, config groups, `_self_` ordering); `ppo_trainer` there names tiller's own defaults;
- overrides are parsed by Hydra's own parser (`OverridesParser`): quoting, lists `[a,b]`, dicts `{a: 1}`,
  `null`, interpolations `${...}`, and applied with Hydra's semantics: `key=v` changes, `+key=v` adds
  (an error if the key is already set), `++key=v` adds or changes, `~key` / `~key=v` deletes (a typed key
  cannot vanish: it goes back to its default, which is what verl's code falls back to);
- a single value given to a list-of-strings key is a one-element list (`data.train_files=a.parquet`).
What this module adds is the user-facing errors:
- an unknown key names itself and the closest valid keys (`algorithm.adv_estimatr` ->
  `did you mean algorithm.adv_estimator?`);
- a wrong type names the key, the value and the expected type;
- new keys only go inside an open-ended section (a `dict[str, Any]` field).
The keys a user gave (file and command line) are kept with the result (`given_keys(cfg)`), for the
verl edge (`tiller.config.edge`): deprecated keys and no-op keys are judged by what was written.
Cross-field checks live with each schema (`tiller.config.validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import pickle
import re
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from tiller.config.edge import refuse_engines_first
from tiller.config.given import given_keys, GIVEN_KEYS_ATTR
from tiller.config.schema import RLConfig
from tiller.config.validate import validate_rl
from tiller.errors import ConfigError

T = TypeVar("T")
PRESET_DIR = Path(__file__).parent / "presets"


# ------------------------------------------------------------------------------ schema introspection


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unwrap_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def _is_open_dict(tp: Any) -> bool:
    tp = _unwrap_optional(tp)
    return typing.get_origin(tp) is dict or tp is dict


def schema_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of a dataclass tree -> its type (sections included)."""
    out: dict[str, Any] = {}
    for name, tp in _field_types(cls).items():
        path = f"{prefix}{name}"
        out[path] = tp
        inner = _unwrap_optional(tp)
        if dataclasses.is_dataclass(inner):
            out.update(schema_paths(inner, path + "."))
    return out


def _type_name(tp: Any) -> str:
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(arg)}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _suggest(key: str, valid: list[str]) -> str:
    """'; did you mean X?' for a mistyped dotted key: siblings first, then the same leaf anywhere."""
    parent, _, leaf = key.rpartition(".")
    siblings = {p.rpartition(".")[2]: p for p in valid if p.rpartition(".")[0] == parent}
    close = [siblings[s] for s in difflib.get_close_matches(leaf, list(siblings), n=2, cutoff=0.7)]
    if not close:
        leaves: dict[str, list[str]] = {}
        for p in valid:
            leaves.setdefault(p.rpartition(".")[2], []).append(p)
        for s in difflib.get_close_matches(leaf, list(leaves), n=2, cutoff=0.8):
            close += leaves[s][:2]
    if not close:
        close = difflib.get_close_matches(key, valid, n=2, cutoff=0.8)
    return f"; did you mean {' or '.join(close[:3])}?" if close else ""


# ------------------------------------------------------------------------------------ key checking


def _check_keys(node: Any, cls: type, prefix: str, source: str, paths: dict[str, Any]) -> None:
    """Reject keys of a user mapping that the dataclass `cls` does not define."""
    if not isinstance(node, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'the config'} must be a mapping of keys, got {node!r}")
    types = _field_types(cls)
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key not in types:
            raise ConfigError(f"{source}: unknown key {path!r}{_suggest(path, list(paths))}")
        inner = _unwrap_optional(types[key])
        if dataclasses.is_dataclass(inner) and value is not None:
            _check_keys(value, inner, path + ".", source, paths)


def _is_str_list(tp: Any) -> bool:
    tp = _unwrap_optional(tp)
    return typing.get_origin(tp) is list and typing.get_args(tp) in ((str,), ())


def _coerce_str_lists(node: Any, cls: type) -> Any:
    """A file's scalar under a list-of-strings key becomes a one-element list (verl takes a path or a list)."""
    if not isinstance(node, dict):
        return node
    types = _field_types(cls)
    for key, value in node.items():
        tp = types.get(key)
        if tp is None:
            continue
        inner = _unwrap_optional(tp)
        if dataclasses.is_dataclass(inner):
            _coerce_str_lists(value, inner)
        elif _is_str_list(tp) and isinstance(value, str) and not value.startswith("${"):
            node[key] = [value]
    return node


def _parse_overrides(items: list[str] | tuple[str, ...]) -> list:
    """Hydra's own parser: one `Override` per command-line item (ConfigError naming the item)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for item in items:
        try:
            (override,) = parser.parse_overrides([item])
        except HydraException as err:
            msg = " ".join(str(err).split())
            raise ConfigError(f"command line: {item!r} is not a valid override: {msg}") from None
        if override.package is not None:
            raise ConfigError(f"command line: {item!r} selects a config group; tiller has no config groups "
                              "(set the keys themselves)")
        if override.is_sweep_override():
            raise ConfigError(f"command line: {item!r}: comma-separated values are a Hydra sweep (multirun); "
                              "a list is written in brackets: key=[a,b]")
        out.append(override)
    return out


def _override_value(override, key: str, paths: dict[str, Any]) -> Any:
    value = override.value()
    tp = paths.get(key)
    raw = override.input_line.split("=", 1)[1] if "=" in (override.input_line or "") else ""
    if tp is not None and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and _unwrap_optional(tp) is str:
        value = raw.strip()  # Hydra reads 0.5_2 as 0.52 and 2_1 as 21: a string key keeps what was typed
    if tp is not None and _is_str_list(tp) and isinstance(value, str) and not value.startswith("${"):
        value = [value]  # verl takes a path or a list
    return value


def _open_parent(key: str, paths: dict[str, Any]) -> str | None:
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    return next((p for p in _prefixes(parent) if p in paths and _is_open_dict(paths[p])), None)


def _apply_override(cfg: DictConfig, override, paths: dict[str, Any], schema: type, given: set[str]) -> str:
    """Apply one parsed override with Hydra's semantics and tiller's errors; returns its key.

    One departure: `+key=v` on a key of tiller's schema, or on a key of a default mapping (verl's `megatron`,
    `reward.reward_kwargs` ...), that nothing set yet sets it. tiller's tree holds the keys of every verl version, so a
    key a script adds with `+` (absent from its verl's tree) is here already."""
    key = override.key_or_group
    line = override.input_line
    known = key in paths
    open_parent = None if known else _open_parent(key, paths)
    if not known and open_parent is None:
        if override.is_add():
            raise ConfigError(
                f"command line: {line}: only open-ended sections accept new keys "
                f"({', '.join(p for p, t in paths.items() if _is_open_dict(t))}){_suggest(key, list(paths))}")
        raise ConfigError(f"command line: unknown key {key!r}{_suggest(key, list(paths))}")
    current = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    exists = known or _has_key(cfg, key)
    if override.is_delete():
        value = override.value()
        if not exists:
            raise ConfigError(f"command line: {line}: cannot delete {key!r}, it is not set")
        if value is not None and value != _plain(current):
            raise ConfigError(f"command line: {line}: the value of {key!r} is {_plain(current)!r}, not {value!r}")
        if known:  # a typed key cannot vanish: back to its default
            default = OmegaConf.select(structured(schema), key)
            _update(cfg, key, default, paths, merge=False)
        else:
            parent, _, leaf = key.rpartition(".")
            with _open_struct(cfg):
                del OmegaConf.select(cfg, parent)[leaf]
        return key
    value = _override_value(override, key, paths)
    if override.is_add():
        if known and key in given and current is not None and not isinstance(value, (dict, list)):
            raise ConfigError(f"command line: {key!r} is already set; drop the '+' to override it "
                              f"({line[1:]}), or write ++{line[1:]}")
        if not known and exists and _given_here(key, given) and not isinstance(value, (dict, list)):
            raise ConfigError(f"command line: {key!r} already exists; drop the '+' to override it ({line[1:]})")
        _update(cfg, key, value, paths, merge=True, add=not known)
    elif override.is_force_add():
        _update(cfg, key, value, paths, merge=True, add=not known)
    else:
        if not exists:
            raise ConfigError(f"command line: {key!r} is not a key of {open_parent!r}; add it with +{line}")
        _update(cfg, key, value, paths, merge=True)
    return key


def _given_here(key: str, given: set[str]) -> bool:
    """The user set `key` (or a mapping holding it) earlier on the command line or in the file."""
    return any(key == g or key.startswith(g + ".") for g in given)


def _has_key(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def _update(cfg: DictConfig, key: str, value: Any, paths: dict[str, Any], *, merge: bool, add: bool = False) -> None:
    try:
        if add:
            with _open_struct(cfg):
                OmegaConf.update(cfg, key, value, merge=merge, force_add=True)
        else:
            OmegaConf.update(cfg, key, value, merge=merge)
    except OmegaConfBaseException:
        expected = _type_name(paths.get(key, Any))
        raise ConfigError(
            f"command line: {key} = {value!r} is not a valid {expected} (expected type: {expected})"
        ) from None


def _leaf_keys(node: Any, prefix: str, paths: dict[str, Any]) -> set[str]:
    """Dotted keys a user mapping sets: leaves, and open-ended sections as a whole."""
    out: set[str] = set()
    if not isinstance(node, dict):
        return out
    for key, value in node.items():
        path = f"{prefix}{key}"
        out.add(path)
        if isinstance(value, dict) and path in paths and not _is_open_dict(paths[path]):
            out |= _leaf_keys(value, path + ".", paths)
    return out


def _prefixes(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts) - 1, -1, -1)]


# ------------------------------------------------------------------------------------------- loading


def _format_omegaconf_error(err: OmegaConfBaseException, paths: dict[str, Any], source: str) -> str:
    key = getattr(err, "full_key", None) or ""
    value = getattr(err, "value", None) if hasattr(err, "value") else None
    if key and key in paths:
        expected = _type_name(paths[key])
        shown = f"{value!r}" if value is not None else "the given value"
        return f"{source}: {key} = {shown} is not a valid {expected} (expected type: {expected})"
    msg = str(err).splitlines()[0]
    return f"{source}: {key + ': ' if key else ''}{msg}"


def _interpolation_error(node: DictConfig | ListConfig, prefix: str = "") -> str | None:
    """The first `${...}` in `node` that does not resolve, as one line naming the key that holds it and the target
    (`config: trainer.experiment_name = '${nope.x}': its interpolation target 'nope.x' does not exist`)."""
    keys = list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))
    for key in keys:
        path = f"{prefix}{key}"
        if OmegaConf.is_interpolation(node, key):
            try:
                node[key]
            except OmegaConfBaseException as err:
                held = node._get_node(key)._value()  # type: ignore[union-attr]
                first = str(err).splitlines()[0]
                missing = re.fullmatch(r"Interpolation key '(.+)' not found", first)
                why = f"its interpolation target {missing.group(1)!r} does not exist" if missing else first
                return f"config: {path} = {held!r}: {why}"
            continue
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none():
            found = _interpolation_error(child, path + ".")
            if found:
                return found
    return None


def _merge(base: DictConfig, other: Any, paths: dict[str, Any], source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        raise ConfigError(_format_omegaconf_error(err, paths, source)) from None


# names a YAML's `defaults:` list may give for the base config: tiller's own defaults (the schema)
BASE_CONFIG_NAMES = ("ppo_trainer",)


def _default_targets(path: Path, root: Path) -> list[Path]:
    """The YAML files a config file's `defaults:` list names (Hydra's rules: an entry is relative to the file's own
    group dir, `/x` to the primary config's dir; `{group: option}` is `group/option.yaml`); unreadable ones skipped."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    entries = data.get("defaults") if isinstance(data, dict) else None
    out: list[Path] = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str) and entry != "_self_":
            names = [entry]
        elif isinstance(entry, dict):
            names = [f"{str(k).split()[-1]}/{v}" for k, v in entry.items() if isinstance(v, str)]
        else:
            continue
        for name in names:
            name = name.split("@", 1)[0].strip()
            base = root if name.startswith("/") else path.parent
            target = base / f"{name.lstrip('/')}.yaml"
            if target.is_file():
                out.append(target)
    return out


def _defaults_cycle(path: Path) -> list[Path] | None:
    """A cycle of `defaults:` lists reachable from `path` (a -> b -> a), or None."""
    root = path.parent
    stack: list[Path] = []

    def visit(node: Path) -> list[Path] | None:
        key = node.resolve()
        if key in [p.resolve() for p in stack]:
            start = [p.resolve() for p in stack].index(key)
            return stack[start:] + [node]
        stack.append(node)
        for target in _default_targets(node, root):
            found = visit(target)
            if found:
                return found
        stack.pop()
        return None

    return visit(path)


def _compose_yaml(path: Path) -> dict:
    """The file composed by `hydra.compose` (its `defaults:` list resolved), as a plain mapping."""
    import warnings

    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException

    cycle = _defaults_cycle(path)
    if cycle:
        names = " -> ".join(str(p.relative_to(path.parent)) if p.is_relative_to(path.parent) else str(p)
                            for p in cycle)
        raise ConfigError(f"{path}: the defaults: lists form a cycle ({names}); remove one of these entries")
    store = ConfigStore.instance()
    for name in BASE_CONFIG_NAMES:
        store.store(name=name, node={})  # the structured defaults come first anyway
    try:
        with warnings.catch_warnings():
            # verl's YAMLs name its own config dir in `hydra.searchpath`: nothing to find there
            warnings.filterwarnings("ignore", message=r".*provider=hydra\.searchpath.*is not available")
            with initialize_config_dir(config_dir=str(path.parent.resolve()), version_base="1.3"):
                composed = compose(config_name=path.stem)
    except (HydraException, OmegaConfBaseException) as err:
        msg = " ".join(str(err).split("\n\nConfig search path")[0].split())
        raise ConfigError(f"{path}: {msg}") from None
    except RecursionError:  # a cycle _defaults_cycle could not follow (a search path, a config group default)
        raise ConfigError(f"{path}: the defaults: lists form a cycle (a config that includes itself through "
                          "its defaults)") from None
    return OmegaConf.to_container(composed, resolve=False)  # type: ignore[return-value]


def _drop_targets(node: Any) -> None:
    """verl's YAMLs name the Python class of each section in `_target_` (for its own instantiation); tiller's schema
    is its own, so these keys carry no setting and are dropped from a file."""
    if isinstance(node, dict):
        node.pop("_target_", None)
        for value in node.values():
            _drop_targets(value)


def _load_yaml(path: Path, cls: type, paths: dict[str, Any]) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}): save the config as UTF-8") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys, got {raw!r}")
    data = _compose_yaml(path) if path.suffix in (".yaml", ".yml") else raw
    data.pop("hydra", None)
    _drop_targets(data)
    _check_keys(data, cls, "", str(path), paths)
    return _coerce_str_lists(data, cls)


def preset_path(name: str) -> Path:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(names) or 'none'}")
    return path


def load_config(
    overrides: list[str] | tuple[str, ...] = (),
    config_file: str | Path | None = None,
    schema: type[T] | None = None,
    preset: str | None = None,
    validate: Callable[[Any], None] | None = None,
) -> T:
    """Resolve defaults <- preset <- config_file <- overrides into a validated dataclass instance."""
    if schema is None:
        schema = RLConfig  # type: ignore[assignment]
        if validate is None:
            validate = validate_rl
    paths = schema_paths(schema)
    cfg = structured(schema)
    given: set[str] = set()
    sources = [(preset_path(preset), False)] if preset else []
    sources += [(Path(config_file), True)] if config_file else []
    for source, by_user in sources:
        data = _load_yaml(source, schema, paths)
        if by_user:
            given |= _leaf_keys(data, "", paths)
        cfg = _merge(cfg, data, paths, str(source))
    parsed = _parse_overrides(overrides)
    if schema is RLConfig:  # a Megatron / VeOmni script stops on that, before any key only those engines have

        refuse_engines_first([(o.key_or_group.lstrip("+~"), o.value()) for o in parsed if not o.is_delete()])
    for override in parsed:
        key = _apply_override(cfg, override, paths, schema, given)
        value = override.value() if not override.is_delete() else None
        given |= {key} | (_leaf_keys(value, key + ".", paths) if isinstance(value, dict) else set())
    try:
        OmegaConf.resolve(cfg)
        obj = OmegaConf.to_object(cfg)
    except InterpolationResolutionError as err:
        raise ConfigError(_interpolation_error(cfg) or _format_omegaconf_error(err, paths, "config")) from None
    except OmegaConfBaseException as err:
        raise ConfigError(_format_omegaconf_error(err, paths, "config")) from None
    object.__setattr__(obj, GIVEN_KEYS_ATTR, frozenset(given))
    if validate is not None:
        validate(obj)
    return obj  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _structured_pickle(schema: type) -> bytes:
    return pickle.dumps(OmegaConf.structured(schema))


def structured(schema: type) -> DictConfig:
    """A fresh `OmegaConf.structured(schema)` of the defaults: built once per schema and process, copied after
    (unpickling is ~15x faster than building it again, and `load_config` runs many times in some processes)."""
    return pickle.loads(_structured_pickle(schema))


class _open_struct:
    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, True)


def to_dict(cfg: Any) -> dict:
    """A plain dict of a config dataclass (for logging and checkpoints)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)


def from_dict(data: dict, schema: type[T]) -> T:
    """Rebuild a config dataclass from `to_dict` output (e.g. a checkpoint's config.yaml)."""
    cfg = OmegaConf.merge(structured(schema), data)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


__all__ = ["load_config", "to_dict", "to_yaml", "from_dict", "schema_paths", "preset_path", "given_keys",
           "ListConfig"]
