"""Build hook: the wheel holds the converter's folder, `preprocess/`, as `streamds/preprocess/`.

Only the regular wheel copies it. An editable install copies nothing: it maps `streamds` to the
checkout, where `streamds/preprocess/__init__.py` points the package at `preprocess/`, so the
checkout's own files run (a copy would go stale at the first edit).
"""

from __future__ import annotations

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ConverterFolder(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "standard":
            build_data["force_include"]["preprocess"] = "streamds/preprocess"
