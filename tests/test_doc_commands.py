"""Every command the README and the docs give, run as written as far as it runs before any
worker starts (issue 62): parsed by the CLI's parser, its config loaded with its overrides
(the file, its when_pretrained settings, the checks), a comparison's variants planned, and
`plan` run in full. A command that names a key that no longer exists, a value a check now
refuses or a variant a config has not fails here. The training itself is the slow tier's
and the benchmarks' (docs/benchmarks.md gives those commands, checked against their labels
in test_benchmark_settings.py). Syntax lines (`CONFIG`, `[--option]`, `RUN_DIR`) and
resumes of runs that do not exist are left out."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

DOCS = [ROOT / "README.md", ROOT / "configs" / "README.md", ROOT / "launch" / "README.md"]
DOCS += [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md"]
COMMAND = re.compile(r"((?:torchrun .*?-m )?pipetransformer (?:train|plan|compare|export) .*)")
PLACEHOLDERS = ("CONFIG", "RUN_DIR", "DIR ", "[", "...", "--resume", "<")


def documented_commands() -> list[tuple[str, str]]:
    """(where, the command) of every command in a code block or inline code span."""
    found = []
    for path in DOCS:
        text = path.read_text()
        lines = []
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            lines += re.sub(r"\\\n\s*", " ", block).splitlines()
        lines += re.findall(r"`(pipetransformer [^`]*)`", text.replace("\n", " "))
        for line in lines:
            match = COMMAND.search(line.strip())
            if match and not line.strip().startswith("#"):
                command = match.group(1).split("  #")[0].split(" # ")[0].strip()
                found.append((path.relative_to(ROOT).as_posix(), command))
    return found


def concrete(command: str) -> bool:
    return not any(mark in command for mark in PLACEHOLDERS) and " export " not in command


COMMANDS = sorted({c for c in documented_commands() if concrete(c[1])})


def test_the_documented_commands_are_found():
    """A change to the extraction that finds nothing would pass every case below."""
    assert len(COMMANDS) >= 15
    assert any("model.model_name_or_path=$MINILM" in c for _, c in COMMANDS)


@pytest.mark.parametrize("where, command", COMMANDS, ids=[c for _, c in COMMANDS])
def test_a_documented_command_runs_as_written(where, command, tmp_path, monkeypatch):
    from pipetransformer.cli.parser import build_parser
    from pipetransformer.compare import CompareRequest
    from pipetransformer.compare.variants import plan_variants
    from pipetransformer.config import load_config

    model = tmp_path / "minilm"  # $MINILM: a model directory (read by the workers only)
    model.mkdir()
    words = shlex.split(command.replace("$MINILM", str(model)))
    words = words[words.index("pipetransformer") + 1 :] if "torchrun" in words else words[1:]
    monkeypatch.chdir(ROOT)
    if words[0] == "plan":
        result = run_cli(*words)
        assert result.returncode == 0, f"{where}: {result.stderr[-2000:]}"
        return
    args, extra = build_parser().parse_known_args(words)
    overrides = [*args.overrides, *extra]
    config = load_config(args.config, overrides)
    if words[0] == "compare":
        request = CompareRequest(
            args.config, Path(args.out or tmp_path / "out"), overrides, peers=args.peers
        )
        assert plan_variants(config, request)
