"""The keys a user gave: `load_config` (`tiller.config.loader`) stamps them on the config it returns, and the
verl edge (`tiller.config.edge`) judges deprecated and no-op keys by what was written, not by value."""

from __future__ import annotations

from typing import Any

GIVEN_KEYS_ATTR = "_tiller_given_keys"


def given_keys(cfg: Any) -> frozenset[str] | None:
    """The dotted keys the user set (config file and command line; a preset's do not count) for a config
    returned by `load_config`, or None for one built otherwise."""
    return getattr(cfg, GIVEN_KEYS_ATTR, None)
