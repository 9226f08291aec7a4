"""`tinyloop <model> lens`: the top token after each loop at every position, and a depth x position heatmap."""

from __future__ import annotations

import io
import os
import sys
import tempfile

from tinyloop.cli.args import CliError, Parser, argv_bytes, loop_count


def build_parser() -> Parser:
    p = Parser(prog="tinyloop lens", description="Show what the model would predict after each loop.")
    p.add_argument("--prompt", required=True, help="text to score (raw bytes for byte-vocabulary models)")
    p.add_argument("--loops", type=loop_count, default=8, help="loop iterations (default: 8)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw a heatmap to this PNG")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    return p


def _show(token: int) -> str:
    special = {10: "\\n", 9: "\\t", 32: "·"}
    if token in special:
        return special[token]
    return chr(token) if 32 < token < 127 else f"<{token}>"


def run_lens(path: str, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    prompt = argv_bytes(args.prompt)
    if not prompt:
        raise CliError("--prompt must not be empty")
    from tinyloop.format.header import read_header

    file_header = read_header(path)
    cfg = file_header.config
    if cfg.tokenizer != "bytes" or "tokenizer" in file_header.metadata:
        raise CliError("lens needs a byte-vocabulary model in this version")
    if len(prompt) > cfg.max_position:
        raise CliError(f"--prompt has {len(prompt)} bytes, more than the model's maximum position {cfg.max_position}")
    if args.plot:
        check_writable(args.plot, "--plot")
    import numpy as np

    from tinyloop.api.model import Model

    with Model(path, max_seq_len=len(prompt), device=args.device) as model:
        lens = model.score_logit_lens(list(prompt), loops=args.loops)
    assert isinstance(lens, np.ndarray)
    shifted = lens - lens.max(-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)  # [L, T, V]
    top = probs.argmax(-1)
    final = top[-1]
    final_prob = np.take_along_axis(probs, final[None, :, None].repeat(args.loops, 0), -1)[..., 0]  # [L, T]
    header = "pos  input  " + " ".join(f"L{d + 1:<3d}" for d in range(args.loops))
    print(header)
    for t, tok in enumerate(prompt):
        cells = " ".join(f"{_show(int(top[d, t])):<4s}" for d in range(args.loops))
        print(f"{t:<4d} {_show(tok):<6s} {cells}")
    if args.plot:
        _plot(args.plot, prompt, final_prob, final)
        print(f"heatmap written to {args.plot}", file=sys.stderr)
    return 0


def _plot(path: str, prompt: bytes, final_prob: object, final: object) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError("--plot needs matplotlib (pip install 'loopformer[plot]')") from None
    import numpy as np

    data = np.asarray(final_prob)
    loops, T = data.shape
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * T + 2), max(2.5, 0.35 * loops + 1.5)))
    im = ax.imshow(data, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(T))
    ax.set_xticklabels([_show(b) for b in prompt], fontsize=7)
    ax.set_yticks(range(loops))
    ax.set_yticklabels([str(d + 1) for d in range(loops)])
    ax.set_xlabel("input position (the model predicts the next byte)")
    ax.set_ylabel("loop depth")
    ax.set_title("probability of the final prediction after each loop")
    for t, tok in enumerate(np.asarray(final)):
        ax.text(t, loops - 1, _show(int(tok)), ha="center", va="center", fontsize=6, color="white")
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=130)
    plt.close(fig)
    write_atomically(path, png.getvalue(), "--plot")


def check_writable(path: str, flag: str) -> None:
    """Refuse an output path whose folder is missing or not writable before any work is done."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"{flag}: {path} is a directory, expected a file name")
    if not os.path.isdir(folder):
        raise CliError(f"{flag}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise CliError(f"{flag}: the folder {folder} is not writable")


def write_atomically(path: str, data: bytes, flag: str) -> None:
    """The whole file or none of it: written beside `path`, then renamed over it."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tinyloop-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        raise CliError(f"{flag}: cannot write {path}: {exc.strerror or exc}", code=1) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
