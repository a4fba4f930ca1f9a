"""Turn a Problem's prompt into the text a policy reads."""

from __future__ import annotations

from typing import Any

from vespo.types import Problem


def render_prompt(problem: Problem, tokenizer: Any = None) -> str:
    """The prompt as text: a message list goes through the tokenizer's chat template (with the
    generation prompt) when it has one, and otherwise is the message contents joined by newlines;
    a string prompt is returned unchanged."""
    prompt = problem.prompt
    if isinstance(prompt, str):
        return prompt
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return "\n".join(message["content"] for message in prompt)
