# The operator image: kopf + the Kubernetes client + Anneal's torch-free modules. No torch.
#   docker build -f docker/operator.Dockerfile -t ghcr.io/anneal-dev/anneal-operator:0.1.0 .
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src src
COPY engine engine
COPY agents agents
COPY operator operator
# Only the `operator` extra: the base dependencies are torch-free by design (pyproject.toml).
RUN pip install --no-cache-dir --prefix=/install ".[operator]"

FROM python:3.12-slim
COPY --from=build /install /usr/local
# Fail the build if torch sneaked in, or if the operator does not import without it.
RUN python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
 && python -c "import anneal.operator.main, anneal.operator.progress"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["python", "-m", "anneal.operator"]
