# pipetransformer on CUDA. Build: docker build -t pipetransformer .
# Run one node: docker run --gpus all --ipc=host -v $PWD/runs:/app/runs pipetransformer \
#   launch/run_single_node.sh configs/vit_cifar100.yaml
# --ipc=host (or a large --shm-size) matters: AutoCache keeps frozen-layer outputs in /dev/shm.
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipetransformer ./pipetransformer
COPY configs ./configs
COPY launch ./launch
RUN python -m pip install --no-cache-dir -e . \
    && chmod +x launch/*.sh

ENV PYTHONUNBUFFERED=1
CMD ["pipetransformer", "--help"]
