"""What a comparison was asked to do: the config, the overrides and every option of
`pipetransformer compare`, as one value, and the one command line that makes it again.

The command line is recorded in results.json and report.md, and printed to resume a
stopped comparison; it is built here only, from the request, with the --out that a rerun
needs to find the runs already made.

Owns: `CompareRequest`, its command line and the context the report records (the machine).
Must not: run anything or read run directories.
"""

from __future__ import annotations

import os
import platform
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipetransformer.config import Config
from pipetransformer.data.sources import run_name


@dataclass(frozen=True)
class CompareRequest:
    """`overrides`: as typed; `found`: the overrides every variant adds that were found once
    rather than typed (the task and labels of one's own data), so that every variant trains
    with the same. `seeds` None: one run per variant without setting trainer.seed.
    `budgets` None: the default ladder where it applies (compare/budgets.py). `target`:
    time-to-target's, in the metric's units (None: the reference's median less the margin)."""

    config_path: str | None
    out: Path
    overrides: list[str] = field(default_factory=list)
    ablations: bool = False
    peers: bool = False
    seeds: list[int] | None = None
    margin_points: float | None = None
    only: list[str] | None = None
    budgets: list[int] | None = None
    curves: list[str] | None = None
    target: float | None = None
    found: list[str] = field(default_factory=list)

    @property
    def run_overrides(self) -> list[str]:
        """What every variant's config is loaded with, before the variant's own."""
        return [*self.overrides, *self.found]

    def command_line(self) -> str:
        """The command that makes this comparison, shell-quoted, with --out."""
        options = [
            *(["--peers"] if self.peers else []),
            *(["--ablations"] if self.ablations else []),
        ]
        if self.only is not None:
            options += ["--variants", ",".join(self.only)]
        if self.seeds is not None:
            options += ["--seeds", ",".join(map(str, self.seeds))]
        if self.margin_points is not None:
            options += ["--margin", f"{self.margin_points:g}"]
        if self.budgets is not None:
            options += ["--budgets", ",".join(map(str, self.budgets)) or "none"]
        if self.curves is not None:
            options += ["--curves", ",".join(self.curves)]
        if self.target is not None:
            options += ["--target", f"{self.target:g}"]
        words = ["pipetransformer", "compare", self.config_path or "", *self.overrides, *options]
        return shlex.join([*words, "--out", str(self.out)])

    def context(self, config: Config) -> dict[str, Any]:
        """What results.json and report.md record of the comparison besides its runs."""
        return {
            "config": self.config_path,
            "config_name": run_name(self.config_path, config.data),  # one's own data: its name
            "overrides": self.run_overrides,
            "command": self.command_line(),
            "machine": machine_description(config),
        }


def machine_description(config: Config) -> str:
    device = (
        "CUDA: " + torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and config.trainer.device != "cpu"
        else "CPU"
    )
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {device}, "
        f"{config.nproc_per_node} processes, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )
