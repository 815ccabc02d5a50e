"""The autopipe and autodp sections: whether pipelines compress as layers freeze, how stages
are cut, and whether freed devices become new replicas.

Owns: AutoPipeConfig and AutoDPConfig. Must not: import anything outside config/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipetransformer.config.errors import _fail


@dataclass(frozen=True)
class AutoPipeConfig:
    # False: the 'freeze only' ablation (frozen layers skip backward, layout never changes).
    enabled: bool = True
    # Cost of a frozen (forward-only) sublayer relative to a trained one, for `balance: params`.
    lambda_frozen: float = 1 / 6
    # 'greedy' fills stages towards the average as the paper's Algorithm 1 does (without its
    # variance term); 'optimal' minimises the largest stage exactly.
    partition_method: Literal["greedy", "optimal"] = "greedy"
    # What the compression criterion (the paper's Eq. 2) compares: 'params', the paper's
    # proxy (each stage's parameter size, frozen units at lambda_frozen); 'memory', what the
    # proxy stands for: each stage's predicted peak bytes from the measured unit profile
    # (autopipe/memory.py), without a profile parameters, gradients and optimizer state
    # (autopipe/planner.py).
    compression: Literal["params", "memory"] = "params"

    def __post_init__(self) -> None:
        if not 0 <= self.lambda_frozen <= 1:
            _fail("autopipe.lambda_frozen", f"must be in [0, 1], got {self.lambda_frozen}")


@dataclass(frozen=True)
class AutoDPConfig:
    # False: pipelines compress but freed devices stay idle (no new replicas).
    enabled: bool = True
