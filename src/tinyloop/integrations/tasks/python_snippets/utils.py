"""Loads the task's JSONL from beside this file (lm-eval's custom_dataset hook): no download."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

DATA = Path(__file__).with_name("python_snippets.jsonl")


def load_snippets(**kwargs: Any) -> dict[str, datasets.Dataset]:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
