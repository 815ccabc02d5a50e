"""What the README promises that can be checked without running anything: the two commands
CI and users run, its length, and a Tests section that explains every reason the suite can
give for a skip."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
README = (ROOT / "README.md").read_text()


def readme_tests_section() -> str:
    return README.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]


def _strings(node: ast.AST, names: dict[str, ast.AST]) -> list[str]:
    """The text of a skip reason: a string, the longest literal part of an f-string, the
    strings of an expression choosing between some, or a module-level name bound to one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts = [v.value for v in node.values if isinstance(v, ast.Constant)]
        return [max(parts, key=len).strip()]
    if isinstance(node, ast.IfExp):
        return _strings(node.body, names) + _strings(node.orelse, names)
    if isinstance(node, ast.Name) and node.id in names:
        return _strings(names[node.id], names)
    raise AssertionError(f"a skip reason the README test cannot read: {ast.dump(node)}")


def _bindings(tree: ast.Module) -> dict[str, ast.AST]:
    return {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def skip_reasons() -> set[str]:
    """Every reason pytest.skip, pytest.mark.skip(if) and pytest.importorskip can give in the
    suite (for importorskip: its reason, or without one the module's name)."""
    helpers = _bindings(ast.parse((TESTS / "helpers.py").read_text()))
    reasons = set()
    for path in sorted(TESTS.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {**helpers, **_bindings(tree)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name = node.func.attr
            given = [k.value for k in node.keywords if k.arg == "reason"]
            if name == "importorskip" and given:  # pytest says the reason given, not the name
                reasons.update(_strings(given[0], names))
            elif name in ("skip", "importorskip") and node.args:
                reasons.update(_strings(node.args[0], names))
            elif name in ("skip", "skipif") and given:
                reasons.update(_strings(given[0], names))
    return reasons


def test_every_skip_reason_is_explained_in_the_tests_section():
    reasons = skip_reasons()
    # The kinds the suite has today, so that a reader that finds none fails here.
    assert {"accelerate", "is not present", "needs CUDA"} <= reasons
    missing = sorted(r for r in reasons if r not in readme_tests_section())
    assert not missing, f"README.md's Tests section does not explain: {missing}"


def test_the_first_screen_holds_the_two_commands_and_the_cpu_install():
    first_screen = "\n".join(README.splitlines()[:45])
    commands = (
        'pip install -e ".[dev]" && pipetransformer train configs/quickstart.yaml',
        "pytest ",
        "--index-url https://download.pytorch.org/whl/cpu",
        "](#results)",
        "](#what-it-does)",
    )
    for text in commands:
        assert text in first_screen, text
    headings = [line for line in README.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings)), "a heading appears twice"
    assert len(README.splitlines()) < 300
    for anchor in re.findall(r"\]\(#([a-z-]+)\)", README):  # the links within the page
        assert any(
            re.sub(r"[^a-z0-9 -]", "", h.lstrip("# ").lower()).replace(" ", "-") == anchor
            for h in headings
        ), anchor
