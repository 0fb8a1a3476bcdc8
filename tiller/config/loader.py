"""Load a typed config: defaults <- preset / --config FILE.yaml <- dotted command-line overrides.

Built on omegaconf structured configs. What this module adds is the user-facing errors:
- an unknown key names itself and the closest valid keys (`algorithm.adv_estimatr` ->
  `did you mean algorithm.adv_estimator?`);
- a wrong type names the key, the value and the expected type;
- verl's `+key=value` adds a key only inside an open-ended section (a `dict[str, Any]` field).
Cross-field checks live with each schema (`tiller.config.validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

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


def _parse_override(item: str, paths: dict[str, Any]) -> tuple[str, Any, bool]:
    if "=" not in item:
        raise ConfigError(f"command line: {item!r} is not a key=value override")
    key, raw = item.split("=", 1)
    add = key.startswith("+")
    key = key.lstrip("+").strip()
    if not key:
        raise ConfigError(f"command line: {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and value.lower() in ("null", "none", "~"):
        value = None
    if key in paths:
        if add:
            raise ConfigError(f"command line: {key!r} already exists; drop the '+' to override it")
        return key, value, add
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    open_parent = next((p for p in _prefixes(parent) if p in paths and _is_open_dict(paths[p])), None)
    if open_parent is not None:
        if not add:
            raise ConfigError(
                f"command line: {key!r} is not a key of {open_parent!r}; add it with +{key}={raw}"
            )
        return key, value, add
    if add:
        raise ConfigError(
            f"command line: +{key}: only open-ended sections accept new keys "
            f"({', '.join(p for p, t in paths.items() if _is_open_dict(t))}){_suggest(key, list(paths))}"
        )
    raise ConfigError(f"command line: unknown key {key!r}{_suggest(key, list(paths))}")


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


def _merge(base: DictConfig, other: Any, paths: dict[str, Any], source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        raise ConfigError(_format_omegaconf_error(err, paths, source)) from None


def _load_yaml(path: Path, cls: type, paths: dict[str, Any]) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    data.pop("defaults", None)  # hydra's defaults list has no meaning here
    data.pop("hydra", None)
    _check_keys(data, cls, "", str(path), paths)
    return data


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
        from tiller.config.schema import RLConfig

        schema = RLConfig  # type: ignore[assignment]
        if validate is None:
            from tiller.config.validate import validate_rl

            validate = validate_rl
    paths = schema_paths(schema)
    cfg = OmegaConf.structured(schema)
    for source in ([preset_path(preset)] if preset else []) + ([Path(config_file)] if config_file else []):
        cfg = _merge(cfg, _load_yaml(source, schema, paths), paths, str(source))
    for item in overrides:
        key, value, add = _parse_override(item, paths)
        try:
            if add:
                with _open_struct(cfg):
                    OmegaConf.update(cfg, key, value, merge=True, force_add=True)
            else:
                OmegaConf.update(cfg, key, value, merge=False)
        except OmegaConfBaseException:
            expected = _type_name(paths.get(key, Any))
            raise ConfigError(
                f"command line: {key} = {value!r} is not a valid {expected} (expected type: {expected})"
            ) from None
    try:
        OmegaConf.resolve(cfg)
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(_format_omegaconf_error(err, paths, "config")) from None
    if validate is not None:
        validate(obj)
    return obj  # type: ignore[return-value]


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
    cfg = OmegaConf.merge(OmegaConf.structured(schema), data)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


__all__ = ["load_config", "to_dict", "to_yaml", "from_dict", "schema_paths", "preset_path", "ListConfig"]
