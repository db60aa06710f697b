"""Manifests as YAML text, the way ``pdctl render`` prints them and the golden files pin them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _ManifestDumper(yaml.SafeDumper):
    """Keeps the builders' key order, writes multi-line strings (the router config) as literal blocks, never
    emits anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_ManifestDumper.add_representer(str, _represent_str)


def dump_manifest(obj: dict[str, Any]) -> str:
    return yaml.dump(
        obj,
        Dumper=_ManifestDumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=1_000_000,
    )


def dump_manifests(objects: Iterable[dict[str, Any]]) -> str:
    """A multi-document YAML stream, every document introduced by ``---``."""
    return "".join(f"---\n{dump_manifest(obj)}" for obj in objects)
