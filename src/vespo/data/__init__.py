"""Datasets: loading problems from files, streaming them in seeded epochs, rendering prompts.

    from vespo.data import load_problems, PromptStream, render_prompt
    problems = load_problems("math500.parquet")      # verl-style parquet / jsonl, or plain jsonl
    stream = PromptStream(problems, seed=0)
    text = render_prompt(problems[0], tokenizer)    # chat template for message lists
"""

from vespo.data.loaders import load_problems
from vespo.data.render import render_prompt
from vespo.data.stream import PromptStream

__all__ = ["load_problems", "PromptStream", "render_prompt"]
