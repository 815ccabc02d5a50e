"""pipetransformer: elastic freeze training of Transformers on torch.distributed.pipelining."""

__version__ = "0.1.0"
