"""Fixtures for the training tests: a fake standard library and the corpus built from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tinyloop.train.corpus import build_corpus


def write_fake_stdlib(root: Path) -> None:
    """Kept files with learnable, repetitive Python, plus one file for each skip rule."""
    for i in range(150):
        body = "".join(
            f"def func_{i}_{j}(value, other):\n    total = value + other * {j}\n    return total\n\n\n"
            for j in range(6)
        )
        path = root / ("pkg" if i % 3 else "") / f"mod_{i:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""Module {i}."""\n\nimport os\n\n\n{body}class Box_{i}:\n    pass\n')
    skipped = {
        "test/test_a.py": "x = 1\n",
        "pkg/tests/test_b.py": "x = 2\n",
        "idlelib/idle_test/test_c.py": "x = 3\n",
        "lib2to3/tests/data/d.py": "x = 4\n",
        "site-packages/e.py": "x = 5\n",
        "config-3.11-x86_64-linux-gnu/f.py": "x = 6\n",
        "__pycache__/g.py": "x = 7\n",
        "_sysconfigdata__linux.py": "x = 8\n",
    }
    for rel, text in skipped.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "big.py").write_text("# " + "x" * 200_001 + "\n")
    (root / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (root / "nul.py").write_bytes(b"s = 1\x00\n")
    (root / "notes.txt").write_text("not python\n")


@pytest.fixture(scope="session")
def fake_stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stdlib")
    write_fake_stdlib(root)
    return root


@pytest.fixture(scope="session")
def corpus_dir(fake_stdlib: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(fake_stdlib, out)
    return out


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Toy-sized ops gain nothing from threads, and a busy shared machine makes spinning threads very slow.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
