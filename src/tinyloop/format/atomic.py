"""Atomic output files: written under a temporary name next to the target, renamed over it when complete.

A failure, Ctrl-C or SIGTERM removes the temporary file; one left by a killed process (SIGKILL, a crash)
is removed by the next write to the same target. The published file's mode follows the umask.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from tinyloop import log

_TEMP_RE = re.compile(r"\.(?P<target>.+)\.(?P<pid>[0-9]+)\.[A-Za-z0-9_]+\.tmp")


class _Terminated(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def output_mode() -> int:
    """The mode a new file gets from the umask (what open() would give), read without changing it for long."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove temporary files for `target` whose writing process is gone; returns what was removed."""
    removed: list[Path] = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return removed
    for name in names:
        match = _TEMP_RE.fullmatch(name)
        if match is None or match["target"] != target.name or _alive(int(match["pid"])):
            continue
        stale = target.parent / name
        with contextlib.suppress(OSError):
            stale.unlink()
            removed.append(stale)
            log.info(f"removed {stale}, left by an interrupted write")
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path in the target's directory; publish it as `path` when the block completes.

    Raises FileNotFoundError naming the directory when it does not exist (nothing is created).
    """
    target = Path(os.path.abspath(path))
    if not target.parent.is_dir():
        raise FileNotFoundError(f"{target.parent}: no such directory (the output's folder must exist)")
    remove_stale_temporaries(target)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    with _removed_on_sigterm() as terminated:
        try:
            yield tmp
            os.chmod(tmp, output_mode())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    if terminated:
        signal.raise_signal(terminated[0])  # the previous handler's turn (by default: the process ends)
        raise InterruptedError(f"{target}: not written (interrupted by signal {terminated[0]})")


@contextlib.contextmanager
def _removed_on_sigterm() -> Iterator[list[int]]:
    """Turn SIGTERM into an exception inside the block (main thread only), so cleanup runs; afterwards the
    previous handler is restored and the caller re-raises the signal."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield got
    except _Terminated as exc:
        got.append(exc.signum)
    finally:
        signal.signal(signal.SIGTERM, previous)
