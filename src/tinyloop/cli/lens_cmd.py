"""`tinyloop <model> lens`: the top token after each loop at every position, and a depth x position heatmap."""

from __future__ import annotations

import sys

from tinyloop.cli.args import CliError, Parser, positive_int


def build_parser() -> Parser:
    p = Parser(prog="tinyloop lens", description="Show what the model would predict after each loop.")
    p.add_argument("--prompt", required=True, help="text to score (raw bytes for byte-vocabulary models)")
    p.add_argument("--loops", type=positive_int, default=8, help="loop iterations (default: 8)")
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
    prompt = args.prompt.encode("utf-8")
    if not prompt:
        raise CliError("--prompt must not be empty")
    import numpy as np

    from tinyloop.api.model import Model
    from tinyloop.errors import TinyLoopFormatError

    try:
        model = Model(path, max_seq_len=max(len(prompt), 1), device=args.device)
    except TinyLoopFormatError as exc:
        raise CliError(str(exc), code=1) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    with model:
        if model.header.config.tokenizer != "bytes":
            raise CliError("lens needs a byte-vocabulary model in this version")
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
    fig.savefig(path, dpi=130)
    plt.close(fig)
