"""The rounding-channel kinds a format 2.0 file may store (pure stdlib: the header parser reads them)."""

from __future__ import annotations

from typing import Literal

Channel = Literal["sign", "frac4"]
CHANNELS: tuple[Channel, ...] = ("sign", "frac4")
