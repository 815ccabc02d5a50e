import os
import sys
from pathlib import Path

import pytest
import torch

# Tests run many small processes on few cores: one thread each.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not present")
    return SHARED_DATA


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
