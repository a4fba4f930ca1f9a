"""The import graph of src/vespo (every `import`, also inside functions): no cycle, and no arrow back up
from a stage to the code that drives it (the core never imports the trainer, the lab, the sweep runner, the
integrations or the command line; the trainer never imports the lab, the sweep runner, the integrations or the
command line; the lab analyses runs and never imports the trainer or the sweep runner, which may import both)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
CORE = ("vespo.types", "vespo.errors", "vespo.charset", "vespo.config", "vespo.losses", "vespo.models",
        "vespo.rollout", "vespo.tasks", "vespo.rewards", "vespo.data", "vespo.metrics", "vespo.advantages", "vespo.rundir",
        "vespo.buffer", "vespo.evaluation", "vespo.coefficients", "vespo.plot", "vespo.allocator")
COMMANDS = ("vespo.cli", "vespo.eval_cli", "vespo.plot_cli", "vespo.coefficients_cli")  # the top-level command lines
ABOVE_CORE = ("vespo.trainer", "vespo.lab", "vespo.sweep", "vespo.integrations", *COMMANDS)
ABOVE_TRAINER = ("vespo.lab", "vespo.sweep", "vespo.integrations", *COMMANDS)
ABOVE_LAB = ("vespo.trainer", "vespo.sweep", "vespo.integrations", *COMMANDS)


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the vespo modules it imports (a package import counts as its __init__)."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                base = node.module
                targets.add(base)
                targets |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_import_graph_has_no_cycle():
    graph, state, cycles = import_graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == "open":
            cycles.append(path[path.index(node):] + [node])
            return
        if state.get(node) == "done":
            return
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])
    assert len(graph) > 80 and cycles == [], cycles


def test_no_import_runs_back_up_a_layer():
    graph = import_graph()
    up = [(a, b) for a, targets in graph.items() for b in targets
          if (under(a, CORE) and under(b, ABOVE_CORE)) or (under(a, ("vespo.trainer",)) and under(b, ABOVE_TRAINER))
          or (under(a, ("vespo.lab",)) and under(b, ABOVE_LAB))]
    assert up == []


def test_every_command_is_a_cli_modules_main_and_no_other_module_has_one():
    """`vespo NAME` runs `main(argv: list[str]) -> int` of a module named cli (its package's cli.py, or
    <module>_cli.py beside a top-level module); a library module has no main."""
    from vespo.cli import COMMANDS

    assert all(module.rsplit(".", 1)[-1].endswith("cli") for module, _ in COMMANDS.values()), COMMANDS
    mains = {}
    for path in SRC.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                mains[module_name(path)] = (ast.unparse(node.args), ast.unparse(node.returns))
    assert {m for m in mains if not m.rsplit(".", 1)[-1].endswith("cli")} == set()
    commands = {module for module, _ in COMMANDS.values()}
    assert commands <= set(mains) and {m: a for m, a in mains.items() if m in commands and a != ("argv: list[str]", "int")} \
        == {}
