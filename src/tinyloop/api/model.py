"""`Model`: the public handle on one loaded model — lifecycle, scoring, generation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tinyloop.api.base import MiB
from tinyloop.api.batch import BatchMixin
from tinyloop.api.caching import CachingMixin
from tinyloop.api.introspection import IntrospectionMixin
from tinyloop.api.speculative import SpeculativeMixin
from tinyloop.api.text import TextMixin
from tinyloop.model.weights import weight_bytes
from tinyloop.runtime.token_exit import report_token_exit, score_with_token_exit


class Model(IntrospectionMixin, CachingMixin, TextMixin, SpeculativeMixin, BatchMixin):
    """A loaded `.tinyloop` model (or a built-in one, by name).

    Token inputs are 1-D np.ndarray[int32] (lists accepted; other dtypes only when lossless).
    dtype: torch.float32, torch.bfloat16 or torch.float16 (or its name); None picks float32 on the CPU and
    for models up to d=1024 on CUDA, else bfloat16. loops: 1 to MAX_LOOPS (1024) per call.
    kv_mode ('16bit', 'int8', 'window', 'hidden', 'none') and cache_window (0 = full cache) choose the
    KV cache; left None, TINYLOOP_KV_INT8 / TINYLOOP_KV_H_MODE / TINYLOOP_DISABLE_KV_CACHE decide.
    cross_iter_round: draw the looped INT4 weights afresh at each iteration from the file's rounding
    channels (tinyloop-add-sign-bit), reproducibly for `cross_iter_seed`; True refuses a file without
    channels; left None, TINYLOOP_CROSS_ITER_ROUND decides (and a file without channels runs as is).

    Thread safety: each call (and each open stream) owns its sequence state and working cache; steps
    of one model run one at a time (a lock), so calls from several threads and interleaved streams give
    what each gives alone. `last_stats` is the most recent call's.
    """

    # ---- metadata ---------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        self._check_open()
        out = self.header.config.to_dict()
        out["format_version"] = self.header.format_version_str
        out["bits"] = self.header.quantization.bits
        out["group_size"] = self.header.quantization.group_size
        out["max_seq_len"] = self.max_seq_len
        out["device"] = str(self.device)
        return out

    def vram_usage_mb(self) -> float:
        """Bytes (MiB) this model holds on its device: weights, caches and the step workspace."""
        self._check_open()
        cfg = self.header.config
        total = weight_bytes(self._engine.weights) + self._engine.cos.nbytes + self._engine.sin.nbytes
        if self._engine.noise is not None:
            total += self._engine.noise.nbytes
        total += self._cache_bytes()
        total += self._handle_bytes()
        # One decode step's live activations: hidden states, qkv, MLP, logits (float32 upper bound).
        total += 4 * (4 * cfg.d_model + cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.ffn_dim + cfg.vocab_size)
        # CUDA: what the captured decode graphs and the scoring scratch cache hold, as allocated.
        decoder = self._engine.decoder
        total += getattr(decoder, "graph_bytes", 0) + getattr(decoder, "dense_copy_bytes", 0)
        total += getattr(decoder, "tinygemm_bytes", 0) + getattr(decoder, "mma_int4_bytes", 0)
        scratch = getattr(decoder, "_scratch", None)
        if scratch is not None:
            total += scratch.nbytes
        return total / MiB

    # ---- scoring ------------------------------------------------------------------------------
    def _score_logits(self, tokens: Any, loops: int | None, token_exit: int | None, last_only: bool) -> torch.Tensor:
        self._check_open()
        ids = self._tokens(tokens)
        n_loops = self._loops(loops)
        patience = self.env.token_exit if token_exit is None else token_exit
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"token_exit must be an integer >= 0 (0 disables it), got {token_exit!r}")
        if patience:
            with self._engine.lock:
                res = score_with_token_exit(self._engine, ids, n_loops, patience)
            if self.env.token_exit_verbose:
                report_token_exit(res)
            return res.logits[-1:] if last_only else res.logits
        out = self._engine.step(ids[None], None, n_loops, last_only=last_only)
        assert out.logits is not None
        return out.logits[0]

    def score(self, tokens: Any, loops: int | None = None, token_exit: int | None = None) -> np.ndarray:
        """Next-token logits at every position: float32 [T, V].

        token_exit=N (default: TINYLOOP_TOKEN_EXIT, 0 = off) lets each position stop iterating once its
        argmax has been unchanged for N consecutive loops.
        """
        return self._score_logits(tokens, loops, token_exit, last_only=False).float().cpu().numpy()

    def score_last(self, tokens: Any, loops: int | None = None, token_exit: int | None = None) -> np.ndarray:
        """Next-token logits after the last token: float32 [V]."""
        return self._score_logits(tokens, loops, token_exit, last_only=True)[-1].float().cpu().numpy()

    # ---- generation ------------------------------------------------------------------------------
    def generate_stream(
        self,
        prompt: Any,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        stop_tokens: Any = None,
        stop: Any = None,
        grammar: Any = None,
        l_warmup_tokens: int = 0,
        l_warmup_loops: int = 2,
        logprobs: int | None = None,
        text: bool = False,
    ) -> Iterator[Any]:
        """Yield new token ids one at a time (arguments as in `generate`); with text=True yield
        StreamPiece(token, text) instead (text decoded incrementally from the token bytes).

        Closing the iterator (or breaking out of a for loop) ends generation at once.
        """
        self._check_open()
        ids = self._tokens(prompt, "prompt")
        params = self._params(
            max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop_tokens=stop_tokens, stop=stop, grammar=grammar, l_warmup_tokens=l_warmup_tokens,
            l_warmup_loops=l_warmup_loops, logprobs=logprobs,
        )  # fmt: skip
        return self._stream(ids, params, bool(text))

    def generate(
        self,
        prompt: Any,
        max_tokens: int = 128,
        loops: int | None = None,
        temperature: float = 0.8,
        top_k: int = 50,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        stop_tokens: Any = None,
        stop: Any = None,
        grammar: Any = None,
        l_warmup_tokens: int = 0,
        l_warmup_loops: int = 2,
        logprobs: int | None = None,
    ) -> np.ndarray:
        """New token ids (np.int32) after `prompt`. temperature 0 is greedy; a seed makes sampling repeat.

        stop_tokens: ids that end generation (not returned). stop: strings that end generation, matched
        on the generated bytes across token boundaries (not returned; a token straddling the start of
        one is kept). grammar: a tinyloop.Grammar (or regex str) the text must match; generation ends
        when nothing else can follow, and `last_stats.finished` is False if max_tokens cut it in a
        non-accepting state. l_warmup_tokens / l_warmup_loops: the first N decode steps run at M loops
        (see DepthSchedule for what deeper iterations then read). `last_stats.stop_reason` says why it ended.
        logprobs=k: `last_stats.logprobs` gets each generated token's log-probability under the model and its
        k most likely alternatives (k in 0..20).
        """
        stream = self.generate_stream(
            prompt, max_tokens, loops, temperature, top_k, top_p, seed, stop_tokens=stop_tokens, stop=stop,
            grammar=grammar, l_warmup_tokens=l_warmup_tokens, l_warmup_loops=l_warmup_loops, logprobs=logprobs,
        )  # fmt: skip
        return np.fromiter(stream, dtype=np.int32)


# The reference's `load`: the Model constructor under another name (same arguments).
load = Model


__all__ = ["Model", "load"]
