"""An existing megatron indexed dataset (``<prefix>.bin/.idx``): never re-tokenized, it joins the training blend
as is (so it has no units and no records)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.data.formats.base import Format


class Megatron(Format):
    name = "megatron"
    tokenized = True

    def detect(self, path: str) -> bool:
        return Path(path + ".bin").is_file() and Path(path + ".idx").is_file()

    def files(self, src: Any, key: str) -> list[Path]:
        if not self.detect(src.path):
            raise ValueError(f"{key}.path={src.path!r}: no {src.path}.bin/.idx")
        return []
