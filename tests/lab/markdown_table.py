"""`cells`: a markdown table's cells, for the tests that read the lab's reports and page. A module of its own
(not conftest.py): `from conftest import` picks whichever conftest another test folder loaded first."""


def cells(markdown: str) -> list[list[str]]:
    """The rows of a markdown (pipe) table as lists of cell texts, the header first, the rule left out."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in markdown.strip().splitlines()]
    return [r for r in rows if not all(set(c) <= set("-: ") for c in r)]
