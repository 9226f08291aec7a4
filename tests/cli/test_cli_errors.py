"""Every command with bad input: exactly one line on stderr, exit 2 (usage) or 1 (runtime), no traceback.

In-process (the entry functions called with argv, output captured); subprocesses only for closed pipes.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import random_flat_weights
from tinyloop.cli import add_sign_bit, convert, guard
from tinyloop.cli.main import main
from tinyloop.config import MAX_LOOPS
from tinyloop.presets import preset

LONG = "x" * 1100  # more bytes than test-tiny's 1024 positions


@pytest.fixture(autouse=True)
def quiet(monkeypatch) -> None:
    monkeypatch.setenv("TINYLOOP_LOG_LEVEL", "0")  # errors still print; nothing else on stderr


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    from tinyloop.format.writer import write_model, write_model_streamed

    root = tmp_path_factory.mktemp("bad")
    garbage = root / "garbage.tinyloop"
    garbage.write_bytes(b"TLOOP" + bytes(range(200)))
    cfg = dataclasses.replace(preset("test-tiny"), tokenizer="embedded")
    flat = random_flat_weights(preset("test-tiny"), seed=3)
    text = root / "text.tinyloop"  # token ids are not bytes (its tokenizer is missing: refused at use)
    write_model_streamed(text, cfg, lambda spec: flat[spec.name], bits=16, float_dtype="F32", progress=False)
    plain = root / "plain.tinyloop"
    write_model(plain, preset("test-tiny"), flat, bits=16, float_dtype="F32", progress=False)
    return {"garbage": garbage, "text": text, "plain": plain, "folder": root}


def run_cli(capsysbinary, argv: list[str], entry: Callable[[list[str]], int] = main) -> tuple[int, bytes, str]:
    """Exit status, stdout bytes and stderr text of one command run in this process."""
    code = entry(argv)
    out = capsysbinary.readouterr()
    return code, out.out, out.err.decode("utf-8", "replace")


def assert_one_line(code: int, err: str, expected: int, needle: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1, lines
    assert code == expected, (code, lines[0])
    assert "error: " in lines[0] and needle in lines[0], lines[0]


def tiny_cases(files: dict[str, Path], model: str) -> list[tuple[list[str], int, str]]:
    text, garbage = str(files["text"]), str(files["garbage"])
    return [
        # main: model and command
        ([], 2, "usage"),
        ([model], 2, "missing command"),
        ([model, "frobnicate"], 2, "unknown command"),
        (["inspect", model], 2, f"the model comes first, then the command: tinyloop {model} inspect"),
        (["generate"], 2, "tinyloop <model> generate"),
        (["no-such-model", "generate"], 2, "built-in models"),
        ([str(files["folder"]), "inspect"], 2, "is a directory"),
        # inspect / verify
        ([model, "inspect", "--bogus"], 2, "unrecognized arguments"),
        ([model, "inspect", "--max-seq-len", "0"], 2, "--max-seq-len"),
        ([garbage, "inspect"], 1, garbage),
        ([garbage, "verify"], 1, garbage),
        ([model, "verify", "--json"], 2, "unrecognized arguments"),
        # generate
        ([model, "generate", "--prompt", "hi", "--max-tokens", "1023"], 2, "maximum position 1024"),
        ([model, "generate", "--prompt", LONG, "--max-tokens", "1"], 2, "--prompt (1100 bytes)"),
        ([model, "generate", "--prompt", ""], 2, "--prompt must not be empty"),
        ([model, "generate", "--loops", str(MAX_LOOPS + 1)], 2, f"must be in [1, {MAX_LOOPS}]"),
        ([model, "generate", "--chat"], 2, "--chat: only for models with an embedded tokenizer"),
        ([model, "generate", "--exit-threshold", "0.5"], 2, "--exit-threshold: only for models with"),
        ([model, "generate", "--exit-criterion", "kl", "--min-loops", "2"], 2, "--exit-criterion, --min-loops"),
        ([model, "generate", "--regex", "("], 2, "--regex"),
        ([model, "generate", "--json-schema", "/no/such/schema.json"], 2, "--json-schema"),
        ([model, "generate", "--device", "tpu"], 2, "device"),
        ([model, "generate", "--dtype", "int8"], 2, "--dtype"),
        ([model, "generate", "--stop", ""], 2, "--stop must not be empty"),
        ([model, "generate", "--temperature", "1e-310"], 2, "temperature must be 0 (greedy) or a positive normal"),
        ([model, "generate", "--seed", str(2**64)], 2, "seed must be an integer in [0, 2**64)"),
        ([text, "generate", "--temperature", "1e-310"], 2, "temperature must be 0 (greedy)"),
        ([garbage, "generate"], 1, garbage),
        ([text, "generate", "--prompt", "\udcff\udcfe"], 2, "--prompt is not valid UTF-8"),
        ([text, "generate", "--prompt", "ok", "--stop", "\udcff"], 2, "--stop is not valid UTF-8"),
        ([text, "generate", "--system", "be brief"], 2, "--system is a chat message: it needs --chat"),
        ([text, "generate", "--min-loops", "3"], 2, "--min-loops: these tune --exit-criterion"),
        ([model, "generate", "--l-warmup-L", "3"], 2, "--l-warmup-L: the warm-up depth needs --l-warmup-tokens"),
        ([model, "speculate", "--l-warmup-L", "3"], 2, "--l-warmup-L: the warm-up depth needs --l-warmup-tokens"),
        ([text, "generate", "--prompt", "hi", "--max-tokens", "2"], 2, "no embedded tokenizer"),
        # lens
        ([model, "lens", "--prompt", LONG], 2, "1100 bytes, more than the model's maximum position 1024"),
        ([model, "lens", "--prompt", "abc", "--loops", "0"], 2, "--loops"),
        ([model, "lens", "--prompt", "abc", "--plot", "/no/such/dir/lens.png"], 2, "does not exist"),
        ([model, "lens", "--prompt", "abc", "--plot", str(files["folder"])], 2, "is a directory"),
        ([model, "lens"], 2, "--prompt"),
        ([text, "lens", "--prompt", "abc"], 2, "byte-vocabulary model"),
        # speculate
        ([model, "speculate", "--draft-loops", "4", "--verify-loops", "4"], 2, "--draft-loops (4) must be smaller"),
        ([model, "speculate", "--prompt", "hi", "--max-tokens", "1023"], 2, "maximum position 1024"),
        ([model, "speculate", "--no-stop"], 2, "--no-stop: a byte-level model"),
        ([model, "speculate", "--cache-window", "8"], 2, "--cache-window 8"),
        ([model, "speculate", "--verify-loops", str(MAX_LOOPS + 1)], 2, "--verify-loops"),
        ([text, "speculate", "--prompt", "\udcff"], 2, "--prompt is not valid UTF-8"),
        ([model, "speculate", "--temperature", "1e-310"], 2, "temperature must be 0 (greedy) or a positive normal"),
        ([model, "speculate", "--seed", str(2**64)], 2, "seed must be an integer in [0, 2**64)"),
        # benchmark
        ([model, "benchmark", "--seq-len", "0"], 2, "--seq-len"),
        ([model, "benchmark", "--seq-len", "2000"], 2, "--seq-len 2000 exceeds"),
        ([model, "benchmark", "--seq-len", "8", "--device", "tpu"], 2, "--device"),
        ([garbage, "benchmark"], 1, garbage),
        ([model, "benchmark", "--batch", str(10**7), "--seq-len", "1000", "--device", "cpu"], 1, "out of memory"),
    ]


CASES = tiny_cases({"text": Path("TEXT"), "garbage": Path("GARBAGE"), "folder": Path("FOLDER")}, "MODEL")


@pytest.mark.parametrize("index", range(len(CASES)), ids=[" ".join(c[0])[:60] for c in CASES])
def test_tinyloop_bad_input(tiny_files, bad_files, capsysbinary, index: int) -> None:
    argv, expected, needle = tiny_cases(bad_files, str(tiny_files["f32"]))[index]
    code, out, err = run_cli(capsysbinary, argv)
    assert_one_line(code, err, expected, needle.replace("MODEL", str(tiny_files["f32"])))
    assert out == b""  # refused before any output (no prompt echoed, no half a table)


@pytest.mark.parametrize(
    "argv, expected, needle",
    [
        ([], 2, "the following arguments are required: -o/--output"),
        (["--random", "--preset", "nope", "-o", "x.tinyloop"], 2, "--preset"),
        (["--random", "-o", "x.tinyloop"], 2, "--random needs --preset"),
        (["missing.pt", "--config", "missing.json", "-o", "x.tinyloop"], 2, "missing"),
        (["--from-hf", "/no/such/folder", "-o", "x.tinyloop"], 2, "/no/such/folder"),
        (["--random", "--preset", "test-tiny", "-o", "/no/such/dir/x.tinyloop", "--quiet"], 2, "/no/such/dir"),
        (["--random", "--preset", "test-tiny", "--bits", "3", "-o", "x.tinyloop"], 2, "--bits"),
    ],
)
def test_convert_bad_input(capsysbinary, tmp_path, monkeypatch, argv, expected, needle) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsysbinary, argv, convert.main)
    assert_one_line(code, err, expected, needle)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "argv, expected, needle",
    [
        ([], 2, "required"),
        (["--from-pt", "w.pt", "-i", "in.tinyloop", "-o", "out.tinyloop"], 2, "pass --loop-only"),
        (["--from-pt", "w.pt", "--loop-only", "-i", "in.tinyloop", "-o", "out.tinyloop"], 1, "in.tinyloop"),
        (["--from-pt", "w.pt", "--loop-only", "--frac-bits", "2", "-i", "a", "-o", "b"], 2, "--frac-bits"),
    ],
)
def test_add_sign_bit_bad_input(capsysbinary, tmp_path, monkeypatch, argv, expected, needle) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsysbinary, argv, add_sign_bit.main)
    assert_one_line(code, err, expected, needle)


def test_plot_write_failure_is_a_runtime_error_and_leaves_no_file(
    tiny_files, capsysbinary, tmp_path, monkeypatch
) -> None:
    import tinyloop.cli.lens_cmd as lens_cmd

    def full_disk(self, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    real_fdopen = os.fdopen
    monkeypatch.setattr(lens_cmd.os, "fdopen", lambda fd, mode: _Failing(real_fdopen(fd, mode), full_disk))
    png = tmp_path / "lens.png"
    code, out, err = run_cli(capsysbinary, [str(tiny_files["f32"]), "lens", "--prompt", "abc", "--plot", str(png)])
    assert_one_line(code, err, 1, "--plot: cannot write")
    assert "No space left on device" in err and out.startswith(b"pos")
    assert list(tmp_path.iterdir()) == []  # no partial file, no temp file


class _Failing:
    def __init__(self, f, write):  # type: ignore[no-untyped-def]
        self.f, self._write = f, write

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        self.f.close()

    def write(self, data: bytes) -> int:
        return self._write(self, data)


def test_unexpected_errors_are_one_line_and_level_2_shows_the_traceback(tiny_files, capsysbinary, monkeypatch) -> None:
    import tinyloop.cli.inspect_cmd as inspect_cmd

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyError("boom")

    monkeypatch.setattr(inspect_cmd, "describe", broken)
    code, _, err = run_cli(capsysbinary, [str(tiny_files["f32"]), "inspect"])
    assert_one_line(code, err, 1, "KeyError: 'boom' (TINYLOOP_LOG_LEVEL=2 shows the traceback)")
    monkeypatch.setenv("TINYLOOP_LOG_LEVEL", "2")
    code, _, err = run_cli(capsysbinary, [str(tiny_files["f32"]), "inspect"])
    assert code == 1 and "Traceback" in err
    assert err.strip().splitlines()[-1] == "tinyloop inspect: error: KeyError: 'boom'"


def test_runtime_errors_of_the_library_are_one_plain_line(tiny_files, capsysbinary, monkeypatch) -> None:
    import tinyloop.cli.inspect_cmd as inspect_cmd
    from tinyloop.errors import NonFiniteLogitsError

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise NonFiniteLogitsError()

    monkeypatch.setattr(inspect_cmd, "describe", broken)
    code, _, err = run_cli(capsysbinary, [str(tiny_files["f32"]), "inspect"])
    assert_one_line(code, err, 1, "tinyloop inspect: error: the model produced non-finite logits (NaN or inf)")
    assert "NonFiniteLogitsError" not in err and "TINYLOOP_LOG_LEVEL" not in err


def test_a_prompt_that_is_not_utf8_reaches_a_byte_model_as_its_bytes(tiny_files, capsysbinary) -> None:
    model = str(tiny_files["f32"])
    raw = [model, "generate", "--prompt", "\udcff\udcfeA", "--max-tokens", "6", "--temperature", "0", "--loops", "2"]
    code, out, err = run_cli(capsysbinary, raw)
    assert code == 0, err
    assert out.startswith(b"\xff\xfeA") and len(out) == 3 + 6 + 1
    ids = [0xFF, 0xFE, 0x41]
    import tinyloop

    with tinyloop.Model(model) as m:
        expected = bytes(m.generate(ids, 6, loops=2, temperature=0.0).tolist())
    assert out == b"\xff\xfeA" + expected + b"\n"
    code, out, err = run_cli(capsysbinary, [model, "lens", "--prompt", "\udcff", "--loops", "2"])
    assert code == 0 and "<255>" in out.decode(), err


def test_a_grammar_cut_by_max_tokens_is_reported(tiny_files, capsysbinary) -> None:
    base = [str(tiny_files["f32"]), "generate", "--prompt", "x", "--loops", "2", "--temperature", "0"]
    code, out, err = run_cli(capsysbinary, [*base, "--regex", "[a-z]{8}", "--max-tokens", "3"])
    assert code == 0 and len(out) == 1 + 3 + 1
    assert err.count("warning: --max-tokens 3 ended the output before it matched the grammar") == 1
    code, out, err = run_cli(capsysbinary, [*base, "--regex", "[a-z]{2}", "--max-tokens", "5"])
    assert code == 0 and "warning" not in err and len(out) == 1 + 2 + 1
    code, _, err = run_cli(capsysbinary, [str(tiny_files["f32"]), "speculate", "--prompt", "x", "--regex", "[a-z]{8}",
                                    "--max-tokens", "3", "--draft-loops", "1", "--verify-loops", "2"])  # fmt: skip
    assert code == 0 and err.count("tinyloop speculate: warning: --max-tokens 3 ended") == 1


def run_shell(command: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "TINYLOOP_LOG_LEVEL": "0", **env}
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300, env=full_env
    )


def test_a_closed_pipe_ends_quietly(tiny_files) -> None:
    tl = f"{sys.executable} -m tinyloop.cli.main {tiny_files['f32']}"
    res = run_shell(f"{tl} generate --max-tokens 800 --loops 1 | head -c 10")
    assert res.stdout == "The meanin" and res.stderr == ""
    assert res.returncode == guard.CLOSED_PIPE_STATUS
    res = run_shell(f"{tl} inspect --json | head -n 2")
    assert res.stdout.splitlines()[0] == "{" and res.stderr == ""
    assert res.returncode in (0, guard.CLOSED_PIPE_STATUS)  # 0 when all of it fit in the pipe before head left
    res = run_shell(f"{tl} lens --prompt {'ab' * 400} --loops 1 | head -n 1")
    assert res.stdout.startswith("pos") and res.stderr == ""


def test_convert_entry_point_is_guarded_too(tmp_path) -> None:
    res = run_shell(f"{sys.executable} -m tinyloop.cli.convert --random --preset test-tiny -o {tmp_path}/x/y.tl")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr


def test_ctrl_c_ends_generation_with_130_and_no_traceback(tiny_files) -> None:
    import signal

    env = {**os.environ, "TINYLOOP_LOG_LEVEL": "0"}
    cmd = [sys.executable, "-m", "tinyloop.cli.main", str(tiny_files["f32"]), "generate", "--max-tokens", "1000"]
    # A shell without job control starts background commands with SIGINT ignored, and a child inherits that
    # (Python then installs no handler): the child starts as an interactive terminal's would.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.read(3) == b"The"  # generation has started
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and b"Traceback" not in err and err == b""


def test_guard_statuses(capsys) -> None:
    assert guard.run_guarded("prog", lambda: sys.exit()) == 0
    assert guard.run_guarded("prog", lambda: sys.exit(3)) == 3
    assert capsys.readouterr().err == ""
    assert guard.run_guarded("prog", lambda: sys.exit("bad thing\n  happened")) == 1
    assert capsys.readouterr().err == "prog: error: bad thing happened\n"

    def closed_pipe() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    assert guard.run_guarded("prog", closed_pipe) == guard.CLOSED_PIPE_STATUS
    assert capsys.readouterr().err == ""

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert guard.run_guarded("prog", interrupted) == 130
