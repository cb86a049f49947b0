# The engine image: `anneal serve` (tier and serving pods) and `anneal compile` (the coordinator).
#   docker build -f docker/engine.Dockerfile -t ghcr.io/anneal-dev/anneal-engine:0.1.0 .
# torch's CUDA wheels bring the CUDA runtime; the node needs only the NVIDIA driver (and the
# device plugin exposing nvidia.com/gpu). Triton compiles its launcher with gcc at run time.
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src src
COPY engine engine
COPY agents agents
COPY operator operator
RUN pip install --no-cache-dir --prefix=/install ".[engine,agents,operator]"

FROM python:3.12-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /install /usr/local
RUN python -c "import anneal.engine.plan, anneal.operator.progress" && anneal --help >/dev/null
# Pods run with a read-only root filesystem: every cache lives under the /tmp emptyDir.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/tmp/hf TRITON_CACHE_DIR=/tmp/triton
USER 10001:10001
EXPOSE 8000 8001
ENTRYPOINT ["anneal"]
CMD ["serve", "--help"]
