"""One prompt format for training, scoring and evaluation."""

from __future__ import annotations

INSTRUCTION = "### Instruction:\n"
RESPONSE = "\n\n### Response:\n"


def render_prompt(messages: list[dict]) -> str:
    """Render every message before the final assistant one as the model's prompt."""
    parts = []
    for m in messages:
        if m["role"] == "assistant":
            break
        parts.append(m["content"])
    return INSTRUCTION + "\n\n".join(parts) + RESPONSE


def render_example(messages: list[dict]) -> tuple[str, str]:
    """Return (prompt, response): the response is the last assistant message."""
    response = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
    return render_prompt(messages), response
