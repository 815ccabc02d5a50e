"""Imports go one way: cli -> compare -> (trainer, launcher) -> (autodp, pipe)
-> (freeze, autopipe, autocache, models, data) -> (config, utils). Siblings never import each other."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipetransformer"

LAYERS = {
    "config": 0, "utils": 0,
    "freeze": 1, "autopipe": 1, "autocache": 1, "models": 1, "data": 1,
    "autodp": 2, "pipe": 2,
    "trainer": 3, "launcher": 3,
    "compare": 4,
    "cli": 5, "__main__": 6, "__init__": 0,
}


def component(module_path: Path) -> str:
    relative = module_path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def imported_components(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pipetransformer" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_component_has_a_layer():
    for path in PACKAGE.rglob("*.py"):
        assert component(path) in LAYERS, f"{path}: add its component to LAYERS"


def test_imports_only_point_down():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        own = component(path)
        for target in imported_components(path):
            if target == own:
                continue
            if LAYERS[target] >= LAYERS[own]:
                problems.append(f"{path.relative_to(PACKAGE)} imports pipetransformer.{target}")
    assert not problems, "\n".join(problems)
