"""Build the byte corpus from the running interpreter's standard-library sources, reproducibly.

Rules (also written into manifest.json):
- every regular `*.py` file under the stdlib root, visited in sorted POSIX relative-path order;
  symbolic links are neither followed nor read;
- skipped: any path with a directory component in SKIP_DIRS (installed packages and caches; the test
  suites `test/` are kept: they are ordinary Python and more than double the corpus), any directory named `config-*`
  (build files), build-generated `_sysconfigdata_*.py`, files over MAX_FILE_BYTES bytes (generated
  tables such as `pydoc_data/topics.py`), files that are not valid UTF-8, and files holding a NUL byte;
- a file goes to validation when sha256(relpath) mod VAL_MODULUS == 0 (about 2%, stable across runs
  and machines since it only depends on the path);
- each split is the concatenation, in path order, of b"\\x00" + file bytes: every document starts right
  after a NUL byte, which never occurs in source text, so "\\x00" also serves as a start-of-file prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SEPARATOR = b"\x00"
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
MAX_FILE_BYTES = 200_000
VAL_MODULUS = 50
FILTER_RULES = [
    "regular *.py files under the stdlib root, sorted by POSIX relative path; symlinks skipped",
    f"skip paths with a directory component in {sorted(SKIP_DIRS)}",
    "skip directories named config-* and files named _sysconfigdata_*.py (build-generated)",
    f"skip files larger than {MAX_FILE_BYTES} bytes",
    "skip files that are not valid UTF-8 or that contain a NUL byte",
    f"validation split: int(sha256(relpath).hexdigest(), 16) % {VAL_MODULUS} == 0",
    "each split = concatenation of b'\\x00' + file bytes, in path order",
]


@dataclass
class Selection:
    files: list[tuple[str, bytes]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation(relpath: str) -> bool:
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % VAL_MODULUS == 0


def _skipped_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith("config-")


def select_files(root: Path) -> Selection:
    """The kept (relpath, bytes) pairs under `root`, in sorted relpath order, and skip counts by reason."""
    candidates: list[str] = []
    sel = Selection()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        kept_dirs = []
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                sel.skip("symlink")
            elif _skipped_dir(d):
                sel.skip(f"directory {d if not d.startswith('config-') else 'config-*'}")
            else:
                kept_dirs.append(d)
        dirnames[:] = kept_dirs
        candidates += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    for rel in sorted(candidates):
        path = root / rel
        if path.is_symlink() or not path.is_file():
            sel.skip("symlink or not a regular file")
            continue
        if Path(rel).name.startswith("_sysconfigdata_"):
            sel.skip("build-generated _sysconfigdata_")
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            sel.skip(f"larger than {MAX_FILE_BYTES} bytes")
            continue
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            sel.skip("not UTF-8")
            continue
        if SEPARATOR in data:
            sel.skip("contains NUL")
            continue
        sel.files.append((rel, data))
    return sel


def join_documents(docs: list[bytes]) -> bytes:
    return b"".join(SEPARATOR + d for d in docs)


def split_documents(blob: bytes) -> list[bytes]:
    """Inverse of join_documents."""
    if not blob:
        return []
    if not blob.startswith(SEPARATOR):
        raise ValueError("corpus split does not start with the document separator")
    return blob[1:].split(SEPARATOR)


def build_corpus(root: Path, out: Path) -> dict[str, object]:
    """Write out/train.bin, out/val.bin and out/manifest.json; return the manifest."""
    sel = select_files(root)
    train = [(r, d) for r, d in sel.files if not is_validation(r)]
    val = [(r, d) for r, d in sel.files if is_validation(r)]
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, object] = {}
    for name, files in (("train", train), ("val", val)):
        blob = join_documents([d for _, d in files])
        (out / f"{name}.bin").write_bytes(blob)
        splits[name] = {
            "file": f"{name}.bin",
            "files": len(files),
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
    manifest: dict[str, object] = {
        "python_version": platform.python_version(),
        "implementation": sys.implementation.name,
        "stdlib_root": str(root),
        "filters": FILTER_RULES,
        "separator": "NUL byte (0x00) before every document",
        "files_kept": len(sel.files),
        "files_skipped": dict(sorted(sel.skipped.items())),
        "splits": splits,
        "val_files": [r for r, _ in val],
        "train_files": [r for r, _ in train],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinyloop.train.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--root", type=Path, default=None, help="source root (default: this interpreter's stdlib)")
    args = parser.parse_args(argv)
    manifest = build_corpus(args.root or stdlib_root(), args.out)
    splits = manifest["splits"]
    assert isinstance(splits, dict)
    for name, info in splits.items():
        print(f"{name}: {info['files']} files, {info['bytes']} bytes, sha256 {info['sha256']}")
    print(f"skipped: {manifest['files_skipped']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
