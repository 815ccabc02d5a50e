"""AutoDP: layouts of replicas (topology), their process groups and the control group's
collectives (control), state handoff and the sampler."""

from pipetransformer.autodp.sampler import Batch, EvalSampler, TrainSampler
from pipetransformer.autodp.topology import Layout, Role, dp_degree_for

__all__ = ["Batch", "EvalSampler", "Layout", "Role", "TrainSampler", "dp_degree_for"]
