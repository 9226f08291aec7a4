"""The lm-eval backend on a converted Ouro model: its embedded tokenizer, and exit_threshold read as Ouro's
exit rule (Model.score_exit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from families.family_helpers import copy_vectors
from shared_data import require_module

require_module("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from tinyloop.integrations.lm_eval import TinyLoopLM  # noqa: E402

PAIRS = [("def fibonacci(n):", "\n    return n"), ("The quick brown fox", " jumps over the lazy dog.")]


@pytest.fixture(scope="module")
def ouro_file(tmp_path_factory: pytest.TempPathFactory):
    from tinyloop.convert.from_hf import convert_hf

    root = tmp_path_factory.mktemp("ouro-eval")
    convert_hf(copy_vectors("ouro", root / "ouro-hf"), root / "ouro.tinyloop", progress=False)
    return root / "ouro.tinyloop"


def _expected(model, context: str, continuation: str, logits_of) -> float:  # type: ignore[no-untyped-def]
    whole = model.encode(context + continuation, add_bos=False)
    n = len(whole) - len(model.encode(context, add_bos=False))
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

    for (context, continuation), lp in zip(PAIRS, got, strict=True):
        assert lp == pytest.approx(_expected(model, context, continuation, logits_of), abs=1e-4)
    depth = lm.mean_exit_depth
    assert depth == 4.0 if threshold is None else 1.0 <= depth < 4.0
