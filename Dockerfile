# pipetransformer on CUDA. Build: docker build -t pipetransformer .
# Run one node: docker run --gpus all --ipc=host -v $PWD/runs:/app/runs pipetransformer \
#   launch/run_single_node.sh configs/vit_cifar100.yaml
# --ipc=host (or a large --shm-size) matters: AutoCache keeps frozen-layer outputs in /dev/shm,
# and NCCL's intra-node transport needs it too (docs/gpus.md: the cache budget + 256 MiB a GPU).
# PyPI's Linux x86_64 torch wheels carry their own CUDA 13 runtime (the nvidia-* packages), so
# a plain Python image is enough; the host needs an NVIDIA driver that supports CUDA 13.
# torch is pinned to the release the test suite last passed on (see docs/versions.md); it must
# stay at or above pyproject.toml's minimum (tests/test_versions.py checks).
FROM python:3.11-slim

WORKDIR /app
RUN python -m pip install --no-cache-dir torch==2.14.1 torchvision==0.29.1
COPY pyproject.toml README.md ./
COPY pipetransformer ./pipetransformer
COPY configs ./configs
COPY launch ./launch
RUN python -m pip install --no-cache-dir -e . \
    && chmod +x launch/*.sh

ENV PYTHONUNBUFFERED=1
CMD ["pipetransformer", "--help"]
