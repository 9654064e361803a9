"""The package's imports run one way: entry points -> engine / disaggregation -> models -> layers / attention ->
memory -> kernels -> formats (data and cli_args, which import nothing of ours, sit at the bottom too). A package
that imports one above it, or packages of one rank that import each other in a circle, fail here: the source is
parsed, not run, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import hisparse

ROOT = Path(hisparse.__file__).parent
# Each package's rank: a package may import only packages of a lower rank (or modules of its own).
RANKS = {"formats": 0, "data": 0, "cli_args": 0, "kernels": 1, "distributed": 1, "memory": 2, "attention": 3,
         "layers": 3, "models": 4, "engine": 5, "disaggregation": 5, "server": 6, "bench": 6, "tools": 6}
ENTRY_POINT_RANK = 6  # the other top-level modules: llm, launch_server, demo, plan, bench_serving, ...


def rank(name: str) -> int:
    return RANKS.get(name, ENTRY_POINT_RANK)


def imported_units(path: Path) -> set[str]:
    """The first component after `hisparse.` of everything `path` imports (a package or a top-level module)."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "hisparse" else [f"hisparse.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        units.update(n.split(".")[1] for n in names if n.startswith("hisparse."))
    return units


def unit_of(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def test_every_package_has_a_rank():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(RANKS), f"packages without a rank: {sorted(packages - set(RANKS))}"


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        unit = unit_of(path)
        graph.setdefault(unit, set()).update(imported_units(path) - {unit})
    return graph


def test_no_package_imports_one_above_it():
    wrong = [f"{unit} (rank {rank(unit)}) imports {target} (rank {rank(target)})"
             for unit, targets in import_graph().items() for target in targets if rank(target) > rank(unit)]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_circle_of_imports_between_packages():
    graph = import_graph()
    done, on_path = set(), []

    def visit(unit: str) -> None:
        if unit in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(unit):] + [unit]))
        if unit in done:
            return
        on_path.append(unit)
        for target in sorted(graph.get(unit, ())):
            visit(target)
        on_path.pop()
        done.add(unit)

    for unit in sorted(graph):
        visit(unit)


def test_the_check_catches_a_cycle(tmp_path):
    """The parser sees what the rule needs: a lazy import inside a function, and `from hisparse import x`."""
    source = tmp_path / "example.py"
    source.write_text("from hisparse import engine\n\ndef f():\n    from hisparse.server.args import parse_args\n")
    assert imported_units(source) == {"engine", "server"}
