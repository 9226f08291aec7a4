"""The architecture is interpreted in one place: outside model/ (and the config, conversion, format, training and
CLI modules, which describe or build models), no module reads the injection, the loop norm or the norm placement.
The CPU decode step and the CUDA kernels are backends of model/looped.py's forward (model/ops.py)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tinyloop"
ALLOWED = ("model/", "convert/", "format/", "train/", "cli/", "config.py", "layout.py", "presets.py")
READS = re.compile(r"""(\.|["'])(injection|loop_norm|norm_placement)\b""")


def test_only_model_interprets_injection_loop_norm_and_norm_placement() -> None:
    readers = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if READS.search(line):
                readers.append(f"{rel}:{n}: {line.strip()}")
    assert not readers, "architecture read outside model/:\n" + "\n".join(readers)


def test_the_check_finds_a_reader() -> None:
    line = 'if cfg.injection == "concat":'
    assert READS.search(line) and READS.search('getattr(cfg, "loop_norm")') and not READS.search("# the injection")
