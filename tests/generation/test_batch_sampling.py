"""A batch's sampled rows filtered and drawn together on the device (decode.prepared_picks, as a GPU step does)
draw exactly what each row draws alone; the filters and the draw against float64 definitions written out here."""

from __future__ import annotations

import pytest
import torch

from tinyloop.errors import NonFiniteLogitsError
from tinyloop.runtime.decode import Row, prepared_picks
from tinyloop.runtime.sampling import TokenPicker, drawn_tokens, filtered_probs, filtered_probs_rows
from tinyloop.sampling import SamplingParams

SETTINGS = [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (1.0, 20, 0.5), (2.0, 99, 0.95)]


def by_definition(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the top_k scores (ties with the k-th kept), then the most likely tokens until the mass before
    each one reaches top_p."""
    scores = [float(v) / temperature for v in logits.double()]
    if 0 < top_k < len(scores):
        kth = sorted(scores, reverse=True)[top_k - 1]
        scores = [s if s >= kth else float("-inf") for s in scores]
    probs = torch.softmax(torch.tensor(scores, dtype=torch.float64), -1)
    if top_p < 1.0:
        kept = torch.zeros_like(probs)
        mass = 0.0
        for i in sorted(range(len(scores)), key=lambda i: -float(probs[i])):
            if mass >= top_p:
                break
            kept[i] = probs[i]
            mass += float(probs[i])
        probs = kept
    return probs


def test_rows_filtered_together_equal_each_row_alone_and_the_definition() -> None:
    logits = 3 * torch.randn(len(SETTINGS), 100, generator=torch.Generator().manual_seed(3))
    together = filtered_probs_rows(logits, SETTINGS)
    for b, (t, k, p) in enumerate(SETTINGS):
        assert torch.equal(together[b], filtered_probs(logits[b], t, k, p))
        assert torch.allclose(together[b], by_definition(logits[b], t, k, p), atol=1e-12, rtol=0)


def _rows(settings: list[tuple[float, int, float]]) -> list[Row]:
    rows = []
    for i, (t, k, p) in enumerate(settings):
        params = SamplingParams(max_tokens=4, temperature=t, top_k=k, top_p=p, seed=100 + i)
        rows.append(Row(torch.tensor([1, 2]), 2, 4, TokenPicker(params, None, frozenset())))
    return rows


def test_sampled_rows_prepared_in_a_batch_draw_what_they_draw_alone() -> None:
    logits = 3 * torch.randn(len(SETTINGS) + 1, 100, generator=torch.Generator().manual_seed(4))
    batch, alone = _rows([*SETTINGS, (0.0, 50, 1.0)]), _rows([*SETTINGS, (0.0, 50, 1.0)])
    for _ in range(20):
        prepared = prepared_picks(batch, logits, sampled_in_batch=True)
        assert all(isinstance(prepared[b], int) for b in range(len(SETTINGS)))
        assert prepared[len(SETTINGS)] == int(logits[-1].argmax())
        for b in range(len(batch)):
            assert batch[b].picker.pick(logits[b], prepared[b]) == alone[b].picker.pick(logits[b])
        logits = logits.roll(7, dims=-1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_row_fails_alone_in_a_batch(bad: float) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    logits[1, 7] = bad
    rows = _rows(SETTINGS[:3])
    prepared = prepared_picks(rows, logits, sampled_in_batch=True)
    assert prepared[1] == -1
    with pytest.raises(NonFiniteLogitsError):
        rows[1].picker.pick(logits[1], prepared[1])
    assert rows[0].picker.pick(logits[0], prepared[0]) is not None


def by_definition_draw(probs: list[float], u: float) -> int:
    """The first token whose running sum of probabilities passes u times the total."""
    total, running = sum(probs), 0.0
    for token, p in enumerate(probs):
        running += p
        if running > u * total:
            return token
    return max(t for t, p in enumerate(probs) if p > 0)


def test_draws_follow_the_cumulative_distribution_and_skip_zero_probabilities() -> None:
    gen = torch.Generator().manual_seed(6)
    probs = torch.rand(4, 30, generator=gen, dtype=torch.float64)
    probs[:, ::3] = 0.0  # filtered-out tokens
    probs[1, 25:] = 0.0  # a row whose last tokens are all filtered out
    edges = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5, 0.999999], dtype=torch.float64)
    for uniforms in (edges, torch.rand(4, generator=gen, dtype=torch.float64)):
        tokens = drawn_tokens(probs, uniforms).tolist()
        for b in range(4):
            assert probs[b, tokens[b]] > 0
            assert tokens[b] == by_definition_draw(probs[b].tolist(), float(uniforms[b]))
    many = torch.rand(20000, generator=gen, dtype=torch.float64)
    counts = torch.bincount(drawn_tokens(probs[2:3].expand(20000, -1), many), minlength=30).double()
    assert torch.allclose(counts / 20000, probs[2] / probs[2].sum(), atol=0.012)
