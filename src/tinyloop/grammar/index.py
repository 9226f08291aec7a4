"""Automaton x vocabulary index: per automaton state, the tokens whose bytes can be consumed there."""

from __future__ import annotations

import torch

from tinyloop.grammar.vocab import TokenVocab


class TokenIndex:
    """States are opaque ints. A state's allowed-token mask is built on first visit and cached, so each
    decode step costs a dict lookup plus one masked_fill over the logits.

    Built with outlines-core: it walks every token's bytes through the pattern's DFA (multi-byte tokens
    may cross any number of pattern boundaries) and keeps only transitions that stay live.
    """

    def __init__(self, index: object, vocab_size: int, device: torch.device | str) -> None:
        self._index = index
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.initial: int = index.get_initial_state()  # type: ignore[attr-defined]
        self._masks: dict[int, torch.Tensor] = {}
        self._forbidden: dict[int, torch.Tensor] = {}
        self._done: dict[int, bool] = {}

    @classmethod
    def build(cls, pattern: str, vocab: TokenVocab, device: torch.device | str) -> TokenIndex:
        from outlines_core import Index, Vocabulary

        table: dict[bytes, list[int]] = {}
        for i, piece in enumerate(vocab.pieces):
            if piece is not None:
                table.setdefault(piece, []).append(i)
        # The automaton library wants an end-of-sequence id; one past the vocabulary is never sampled.
        eos = len(vocab)
        try:
            index = Index(pattern, Vocabulary(eos, table))
        except ValueError as exc:
            raise ValueError(f"cannot build a token index for {pattern!r} over this vocabulary: {exc}") from None
        return cls(index, len(vocab), device)

    def allowed(self, state: int) -> torch.Tensor:
        """bool [V]: True where the token may follow in `state`."""
        mask = self._masks.get(state)
        if mask is None:
            ids = [t for t in self._index.get_allowed_tokens(state) if t < self.vocab_size]  # type: ignore[attr-defined]
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[ids] = True
            mask = mask.to(self.device)
            self._masks[state] = mask
            self._done[state] = not ids
        return mask

    def forbidden(self, state: int) -> torch.Tensor:
        """bool [V]: the complement of `allowed` (cached too, so masking is one masked_fill)."""
        mask = self._forbidden.get(state)
        if mask is None:
            mask = self._forbidden[state] = ~self.allowed(state)
        return mask

    def precompute(self) -> int:
        """Build every state's mask now (else lazily); returns the number of states."""
        states = set(self._index.get_transitions())  # type: ignore[attr-defined]
        states.update(self._index.get_final_states())  # type: ignore[attr-defined]
        for s in states:
            self.allowed(s)
        return len(states)

    def advance(self, state: int, token: int) -> int:
        nxt = self._index.get_next_state(state, token)  # type: ignore[attr-defined]
        if nxt is None:
            raise ValueError(f"token {token} is not allowed by the grammar in state {state}")
        return int(nxt)

    def is_final(self, state: int) -> bool:
        """The text so far fully matches: generation may end here."""
        return bool(self._index.is_final_state(state))  # type: ignore[attr-defined]

    def is_done(self, state: int) -> bool:
        """No token can follow: generation ends here."""
        if state not in self._done:
            self.allowed(state)
        return self._done[state]
