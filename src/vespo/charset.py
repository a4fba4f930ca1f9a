"""The character set of vespo's built-in character-level tokenizer.

Every built-in task writes its prompts and answers with these characters only, so a tiny
policy with a ~60-token vocabulary can learn them. ``vespo.models.tokenizer`` builds the
tokenizer from this list; ``vespo.tasks`` checks its texts against it.
"""

DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYMBOLS = " +-*/=()<>,.:;?!#"
CHARSET: str = DIGITS + LETTERS + SYMBOLS

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN)


def unsupported_chars(text: str) -> set[str]:
    """The characters of ``text`` the built-in tokenizer cannot encode."""
    allowed = set(CHARSET)
    return {c for c in text if c not in allowed}
