"""vespo: stable off-policy reinforcement learning for LLMs.

VESPO (variational sequence-level soft policy optimization) and the baselines it is judged
against, a trainer on Hugging Face models, and a small-scale stability lab.

Importing :mod:`vespo` is cheap: heavy dependencies (torch, transformers, ray) load only in
the submodules that need them.
"""

__version__ = "0.1.0"
