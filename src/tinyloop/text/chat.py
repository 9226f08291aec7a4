"""Chat templates of the supported families, written out in Python (no Jinja).

chatml (Ouro): `<|im_start|>{role}\n{content}<|im_end|>\n` per message; generation prompt
`<|im_start|>assistant\n`. No default system message is inserted.
huginn: `<|begin_text|>` then `<|begin_header|>{role}<|end_header|>\n\n{content.strip()}<|end_turn|>` per
message, the assistant role rendered as `Huginn`; generation prompt `<|begin_header|>Huginn<|end_header|>\n\n`,
otherwise `<|end_text|>` closes the text.
plain (byte models, which have no template of their own): `{role}: {content}\n` per message; generation
prompt `assistant:`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant")
PLAIN_TEMPLATE = "plain"


def _messages(messages: Sequence[Any]) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}"[:200])
        out.append((m["role"], m["content"]))
    if not out:
        raise ValueError("a chat needs at least one message")
    return out


def render_chat(template: str, messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}]) under a built-in template."""
    items = _messages(messages)
    if template == PLAIN_TEMPLATE:
        text = "".join(f"{role}: {content}\n" for role, content in items)
        return text + ("assistant:" if add_generation_prompt else "")
    if template == "chatml":
        text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in items)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
    if template == "huginn":
        text = "<|begin_text|>"
        for role, content in items:
            shown = "Huginn" if role == "assistant" else role
            text += f"<|begin_header|>{shown}<|end_header|>\n\n{content.strip()}<|end_turn|>"
        return text + ("<|begin_header|>Huginn<|end_header|>\n\n" if add_generation_prompt else "<|end_text|>")
    raise ValueError(f"this model has no chat template (template {template!r}); use a plain prompt")
