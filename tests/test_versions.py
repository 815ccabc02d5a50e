"""The supported versions are stated in three places that must agree: pyproject.toml's
minimums (what pip enforces), the Dockerfile's base image (what the container runs) and the
README's "Supported versions" line (what a user reads). The minimums are the oldest
releases the test suite was run with (see docs/versions.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "timm")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def pyproject_minimums() -> dict[str, tuple[int, ...]]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = {}
    for requirement in dependencies:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", requirement.strip())
        if match and match.group(1) in PACKAGES:
            found[match.group(1)] = _version(match.group(2))
    return found


def readme_versions() -> dict[str, tuple[int, ...]]:
    lines = [
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("Supported versions:")
    ]
    assert len(lines) == 1, "README.md needs exactly one 'Supported versions:' line"
    return {
        name: _version(v)
        for name, v in re.findall(r"`?(torch|transformers|timm)\s*>=\s*([0-9.]+)`?", lines[0])
    }


def dockerfile_packages() -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
    """(the torch the image runs, every package the Dockerfile pins with == or >=). The torch
    is the base image's when it is a pytorch/pytorch:<version>-... image, else the one the
    Dockerfile pins."""
    text = (ROOT / "Dockerfile").read_text()
    pinned = {
        name: _version(v)
        for name, v in re.findall(r"\b(torch|transformers|timm)\s*[=>]=\s*([0-9.]+)", text)
    }
    base = re.search(r"^FROM\s+pytorch/pytorch:([0-9.]+)-", text, re.MULTILINE)
    torch_version = _version(base.group(1)) if base else pinned.get("torch")
    assert torch_version, (
        "the Dockerfile neither uses a pytorch/pytorch:<version> image nor pins torch"
    )
    return torch_version, pinned


def test_every_minimum_is_stated_in_pyproject():
    assert set(pyproject_minimums()) == set(PACKAGES)


def test_readme_states_the_pyproject_minimums():
    assert readme_versions() == pyproject_minimums()


def test_dockerfile_torch_is_at_least_the_minimum():
    minimums = pyproject_minimums()
    base_torch, pinned = dockerfile_packages()
    assert base_torch >= minimums["torch"], (
        f"the Dockerfile's image has torch {base_torch}, below {minimums['torch']}"
    )
    for name, version in pinned.items():
        assert version >= minimums[name], (
            f"the Dockerfile pins {name} {version}, below {minimums[name]}"
        )


def test_installed_versions_meet_the_minimums():
    """The environment the tests run in satisfies what pyproject.toml states (a stale
    environment would make every other test's verdict meaningless)."""
    import importlib.metadata

    for name, minimum in pyproject_minimums().items():
        assert _version(importlib.metadata.version(name)) >= minimum, name
