"""The lm-eval backend on a converted Ouro model: its embedded tokenizer (lm-eval's context/continuation token
split, contexts shared by several continuations), and exit_threshold read as Ouro's exit rule (Model.score_exit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from families.family_helpers import copy_vectors
from shared_data import require_module

require_module("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from tinyloop.integrations.lm_eval import TinyLoopLM  # noqa: E402

# "The quick brown fo" + "xes" tokenizes apart from its context: lm-eval scores the context's tokens followed by
# the tokens of the whole text after the context's length, and so must the shared context.
PAIRS = [("def fibonacci(n):", "\n    return n"), ("The quick brown fox", " jumps over the lazy dog.")]
PAIRS += [("The quick brown fo", c) for c in ("x jumps", "xes", "ol", " fox")] + [("def fibonacci(n", "):\n    return")]


@pytest.fixture(scope="module")
def ouro_file(tmp_path_factory: pytest.TempPathFactory):
    from tinyloop.convert.from_hf import convert_hf

    root = tmp_path_factory.mktemp("ouro-eval")
    convert_hf(copy_vectors("ouro", root / "ouro-hf"), root / "ouro.tinyloop", progress=False)
    return root / "ouro.tinyloop"


def _expected(lm, context: str, continuation: str, logits_of) -> float:  # type: ignore[no-untyped-def]
    context_ids, continuation_ids = lm._encode_pair(context, continuation)
    whole = np.array(context_ids + continuation_ids, dtype=np.int32)
    n = len(continuation_ids)
    logits = torch.from_numpy(logits_of(whole[:-1])).double()
    logp = torch.log_softmax(logits, dim=-1)[torch.arange(len(whole) - 1), torch.from_numpy(whole[1:]).long()]
    return float(logp[-n:].sum())


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_tokenizer_model_loglikelihood_with_and_without_the_exit_gate(ouro_file, threshold) -> None:
    lm = TinyLoopLM(str(ouro_file), loops=4, exit_threshold=threshold, batch_size=2)
    assert not lm.byte_level and lm.prefix_token_id == lm.model.tokenizer.meta.bos_id
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]  # type: ignore[arg-type]
    got = [lp for lp, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    model = lm.model

    def logits_of(ids: np.ndarray) -> np.ndarray:
        if threshold is None:
            return model.score(ids, loops=4)
        return model.score_exit(ids, loops=4, exit_threshold=threshold)

    splits = [lm._encode_pair(*pair) for pair in PAIRS]
    assert any(c + k != lm.tok_encode(a + b) for (c, k), (a, b) in zip(splits, PAIRS, strict=True))
    for (context, continuation), lp in zip(PAIRS, got, strict=True):
        assert lp == pytest.approx(_expected(lm, context, continuation, logits_of), abs=1e-4)
    depth = lm.mean_exit_depth
    assert depth == 4.0 if threshold is None else 1.0 <= depth < 4.0
