"""Imports go one way: cli -> (compare, export) -> (trainer, integrations, launcher) ->
(tasks, profiling) -> runs -> planning -> fsdp -> (autodp, pipe) -> (anneal, freeze_signal) ->
(freeze, autopipe, autocache, models, data) -> (config, utils). Siblings never import each
other (the trainer and the integrations share the freeze signal's bookkeeping and driver
from below them), and nothing imports a module that imports it back (no cycle,
function-local imports included)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipetransformer"

LAYERS = {
    "config": 0,
    "utils": 0,
    "freeze": 1,
    "autopipe": 1,
    "autocache": 1,
    "models": 1,
    "data": 1,
    "anneal": 1.5,  # layer-wise annealing's plan: reads the freeze rules (freeze.py)
    # The freeze signal's bookkeeping and the decision driver: the trainer's and the
    # integrations' (one implementation both import).
    "freeze_signal": 1.5,
    "autodp": 2,
    "pipe": 2,
    "fsdp": 2.5,  # the sharded layout's runtime: shares the first stage's prefix with pipe/
    "planning": 3,
    "runs": 3.5,  # a run's records, directory, checkpoints and resume: below trainer, launcher
    "tasks": 3.75,  # targets, losses and scoring per head: read a run's EvalResult record
    "profiling": 3.75,  # measuring inside a run, collectively: reads planning's profile keys
    "trainer": 4,
    "integrations": 4,  # callbacks for other trainers: the trainer's sibling, not its user
    "launcher": 4,
    "compare": 5,
    "export": 5,
    "cli": 6,
    "__main__": 7,
    "__init__": 0,
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


def _module_name(path: Path) -> str:
    parts = ["pipetransformer", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles_between_modules():
    """Within a component too: a cycle (planning <-> sizing used to hide behind function-local
    imports) means two modules that can only be understood together."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            targets |= {c for c in candidates if c in modules and c != name}
        # A package's __init__ re-exports its modules: importing it is importing them.
        edges[name] = targets
    cycles = []
    for start in modules:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start and not _package_of(start, path):
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "\n".join(sorted(set(cycles))[:10])


def _package_of(start: str, path: list[str]) -> bool:
    """A package's __init__ importing its own submodules, which import siblings through it,
    is how Python packages re-export names, not a cycle between two modules."""
    return any(start.startswith(p + ".") or p.startswith(start + ".") for p in path[1:])


MAX_FILE_LINES = 700  # the house's limit: a file is read in one sitting


def test_no_package_file_is_over_the_line_limit():
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"over {MAX_FILE_LINES} lines (split a concept into its own module): {long}"


TRAINER_MAX_LINES = 4000  # the loop and what runs during training only; other concepts move out


def test_the_trainer_package_stays_the_loop():
    lines = sum(len(p.read_text().splitlines()) for p in (PACKAGE / "trainer").rglob("*.py"))
    assert lines <= TRAINER_MAX_LINES, (
        f"trainer/ is {lines} lines: move a concept out (as tasks/ and profiling/ were)"
    )


def _chain_groups(text: str, arrow: str) -> list[set[str]]:
    return [{name.strip(" ()") for name in group.split(",")} for group in text.split(arrow)]


def test_the_documented_import_chain_is_the_enforced_one():
    """The chain README.md and this module's docstring state names every component, in the
    order of LAYERS (a component left out of it, as anneal once was, fails here)."""
    readme = (PACKAGE.parent / "README.md").read_text()
    stated = readme.split("Imports go one way: ", 1)[1].split(";", 1)[0]
    docstring = " ".join(__doc__.split("Imports go one way: ", 1)[1].split(". Siblings")[0].split())
    components = {name for name in LAYERS if name not in ("__main__", "__init__")}
    for chain in (_chain_groups(stated, " → "), _chain_groups(docstring, " -> ")):
        named = set().union(*chain)
        assert named == components, f"{sorted(components ^ named)}: in the chain or in LAYERS"
        layers = [{LAYERS[name] for name in group} for group in chain]
        assert all(len(group) == 1 for group in layers), chain
        order = [group.pop() for group in layers]
        assert order == sorted(order, reverse=True), chain


# Files of the project's workspace that a user's clone does not have: what they said that
# the code relies on lives in docs/ (docs/pytorch.md, docs/vocabulary.md).
OUTSIDE_FILES = (
    "PYTORCH_NOTES.md",
    "DESIGN.md",
    "STYLE.md",
    "design document",
    "shared/paper",
)


def test_nothing_cites_a_file_a_clone_does_not_have():
    root = PACKAGE.parent
    found = [
        f"{path.relative_to(root)}: {name}"
        for folder in ("pipetransformer", "tests", "docs", "benchmarks", "configs", "launch")
        for path in sorted((root / folder).rglob("*"))
        if path.suffix in (".py", ".md", ".yaml", ".sh") and path.name != "test_layering.py"
        for name in OUTSIDE_FILES
        if name in path.read_text()
    ]
    readme = (root / "README.md").read_text()
    found += [f"README.md: {name}" for name in OUTSIDE_FILES if name in readme]
    assert not found, found
