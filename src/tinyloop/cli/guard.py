"""The one place the CLI turns exceptions into exit statuses: every error is one line on stderr (exit 2 for
bad arguments, 1 for a failure while running), never a traceback unless TINYLOOP_LOG_LEVEL=2 asks for one;
a reader that closes the pipe early (`| head`) ends the command quietly."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import traceback
from collections.abc import Callable

from tinyloop.cli.args import CliError, parse_or_exit_code

# 128 + SIGPIPE: what a program stopped by a closed pipe reports (as `yes | head` does).
CLOSED_PIPE_STATUS = 141
_shutdown_report_hidden = False


def run_main(
    prog: str,
    build_parser: Callable[[], argparse.ArgumentParser],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None,
) -> int:
    """A console script's `main`: parse `argv` (default: the process's) and `run` the arguments, guarded."""

    def command() -> int:
        args = parse_or_exit_code(build_parser(), sys.argv[1:] if argv is None else argv)
        return args if isinstance(args, int) else run(args)

    return run_guarded(prog, command)


def run_guarded(prog: str, command: Callable[[], int]) -> int:
    """Run `command`, returning its exit status; print what went wrong as `prog: error: ...`."""
    try:
        status = command()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return status
    except SystemExit as exc:  # argparse: --help (0) or a usage error already printed (2)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(f"{prog}: error: {one_line(str(exc.code))}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return CLOSED_PIPE_STATUS
    except Exception as exc:
        code, message = _describe(exc)
        if _log_level() >= 2:
            traceback.print_exc()
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        return code
    finally:
        _hide_shutdown_leak_report()


def one_line(text: str) -> str:
    return " ".join(text.split())


def _describe(exc: Exception) -> tuple[int, str]:
    from tinyloop.errors import OutOfMemoryError, TinyLoopFormatError

    if isinstance(exc, CliError):
        return exc.code, one_line(str(exc))
    if isinstance(exc, TinyLoopFormatError):
        return 1, one_line(str(exc))  # a bad file, not a bad argument
    if isinstance(exc, (ValueError, TypeError)):
        return 2, one_line(str(exc))  # the library refused an argument the CLI passed on
    if isinstance(exc, (OSError, OutOfMemoryError, MemoryError)):
        return 1, one_line(str(exc) or type(exc).__name__)
    if type(exc).__module__.startswith("tinyloop."):  # our own runtime errors say what happened
        return 1, one_line(str(exc))
    hint = "" if _log_level() >= 2 else " (TINYLOOP_LOG_LEVEL=2 shows the traceback)"
    return 1, one_line(f"{type(exc).__name__}: {exc}") + hint


def _log_level() -> int:
    from tinyloop.env import log_level

    return log_level()


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the exit's flush of what is still buffered does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a file (captured in-process): nothing will flush to the closed pipe


def _hide_shutdown_leak_report() -> None:
    """Triton's bindings (nanobind) list every object still alive when the interpreter shuts down, dozens
    of lines after the command's own output; silence stderr once the command is done, as Triton does for
    its own workers. TINYLOOP_LOG_LEVEL=2 keeps the report."""
    global _shutdown_report_hidden
    if _shutdown_report_hidden or "triton" not in sys.modules or _log_level() >= 2:
        return
    _shutdown_report_hidden = True

    def silence() -> None:
        try:
            sys.stderr.flush()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        except (OSError, ValueError):
            pass

    atexit.register(silence)
