"""The CUDA caching allocator's settings, set before anything can initialise CUDA.

The allocator parses its settings (PYTORCH_ALLOC_CONF, or PYTORCH_CUDA_ALLOC_CONF) once, when
CUDA first initialises in the process: a setting made after that is never read. Layouts
free one set of stage sizes and allocate another at every transition, which fragments the
default allocator; expandable segments keep that small (the device budget allows 5% for
what remains, planning/context.py). So the command line sets them first thing, before the
preflight asks the device for its compute capability (which initialises CUDA), and every
process it starts inherits them; `init_distributed` sets them too for a trainer started
otherwise. A setting the user made is kept.

Owns: `use_expandable_segments`. Must not: import torch (it must run before torch can
initialise CUDA).
"""

from __future__ import annotations

import os

EXPANDABLE_SEGMENTS = "expandable_segments:True"
ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def use_expandable_segments() -> None:
    """Expandable segments for this process and those it starts, unless the environment
    already configures the allocator."""
    if not any(os.environ.get(name) for name in ALLOCATOR_ENV):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
