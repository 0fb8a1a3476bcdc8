"""Typed configuration with verl's key names: `load_config`, `RLConfig`, `to_yaml`, `to_dict`."""

from tiller.config.loader import from_dict, load_config, preset_path, schema_paths, to_dict, to_yaml
from tiller.config.schema import RLConfig

__all__ = ["RLConfig", "load_config", "to_yaml", "to_dict", "from_dict", "schema_paths", "preset_path"]
