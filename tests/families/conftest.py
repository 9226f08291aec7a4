"""Converted family checkpoints, written once per session (16-bit = the source's F32)."""

from __future__ import annotations

from pathlib import Path

import pytest
from family_helpers import copy_vectors


@pytest.fixture(scope="session")
def family_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tinyloop.convert.from_hf import convert_hf

    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in ("ouro", "huginn"):
        folder = copy_vectors(family, root / f"{family}-hf")
        out[family] = root / f"{family}.tinyloop"
        convert_hf(folder, out[family], progress=False)
        if family == "huginn":
            out["huginn-zeros"] = root / "huginn-zeros.tinyloop"
            convert_hf(folder, out["huginn-zeros"], progress=False, state_start="zeros")
        out[f"{family}-hf"] = folder
    return out
