"""The libraries a command imports are builds that go together: torch, torchvision (which
timm imports) and timm. A torchvision built for another torch fails inside its own import
("operator torchvision::nms does not exist"), which without this check reached the user as
a traceback from the middle of a model import; here it is one line naming the versions
and the fix, before anything else runs.

Owns: `check_library_builds` and LibraryBuildError. Must not: import anything of this
package beyond the standard library at module level, or install anything.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata


class LibraryBuildError(RuntimeError):
    """torch, torchvision and timm do not import together; says which versions and the fix."""


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def matching_torchvision(torch_version: str) -> str | None:
    """The torchvision release made for a torch 2.x release (0.15 for 2.0, one minor each
    since): '0.29' for '2.14.1+cpu'; None where that rule does not say."""
    match = re.match(r"2\.(\d+)", torch_version)
    return f"0.{int(match.group(1)) + 15}" if match else None


def check_library_builds() -> None:
    """Import torch, torchvision and timm; raise LibraryBuildError, one line, where one of
    them fails to import beside the others."""
    torch_version = _installed("torch")
    for package in ("torch", "torchvision", "timm"):
        try:
            importlib.import_module(package)
        except Exception as exc:  # a build mismatch raises RuntimeError, OSError, ImportError...
            cause = " ".join(str(exc).split()) or type(exc).__name__
            raise LibraryBuildError(_message(package, torch_version, cause)) from exc


def reinstall_options(torch_version: str) -> str:
    """pip options that reinstall a package without touching torch, from the index torch's own
    build came from: its local version tag names it ('2.14.1+cpu': PyTorch's cpu index), no
    tag is PyPI's build. So a CPU machine is not handed PyPI's CUDA build, and a command that
    reinstalls what is already installed takes the right build rather than doing nothing."""
    local = torch_version.partition("+")[2]
    index = f" --index-url https://download.pytorch.org/whl/{local}" if local else ""
    return f"--force-reinstall --no-deps{index}"


def _message(package: str, torch_version: str, cause: str) -> str:
    version = _installed(package)
    options = reinstall_options(torch_version)
    if package == "torch":
        return (
            f"torch {version} does not import ({cause}); reinstall the same build: "
            f"pip install {options} 'torch=={version}'"
        )
    if package == "torchvision":
        wanted = matching_torchvision(torch_version)
        pin = f"'torchvision=={wanted}.*'" if wanted else "torchvision"
        return (
            f"torchvision {version} does not import beside torch {torch_version}, a build "
            f"made for another torch ({cause}); install the torchvision of torch "
            f"{torch_version}'s build: pip install {options} {pin}"
        )
    return (
        f"timm {version} does not import beside torch {torch_version} and torchvision "
        f"{_installed('torchvision')} ({cause}); pip install --upgrade timm"
    )
