# syntax=docker/dockerfile:1
# The teacher on NVIDIA GPUs: the vLLM engine (EOPD_TEACHER_ENGINE=vllm) on the official vLLM/CUDA
# image, with eopd installed in a venv that sees vLLM's packages (torch, vllm, transformers) and
# never upgrades them.
#
#   docker build -f deploy/docker/teacher.Dockerfile -t eopd-teacher:0.1.0 .
#
# No model weights inside: mount a Hugging Face model directory (or .gguf) at /models and set
# EOPD_TEACHER_MODEL=/models/<name>.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---- build: eopd into /opt/venv, pinned by the base image's own packages, then constraints.txt ----
FROM ${VLLM_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
# What the base image installed wins; our pins fill in the rest (names compared normalised).
RUN python3 -m venv --system-site-packages /opt/venv \
 && python3 -m pip freeze --all > /tmp/base.txt \
 && awk -F'==' 'function norm(n) { n = tolower(n); gsub(/[-_.]+/, "-", n); return n } \
      /^#/ || !/==/ { next } NR == FNR { seen[norm($1)] = 1; print; next } !(norm($1) in seen)' \
      /tmp/base.txt deploy/docker/constraints.txt > /tmp/constraints.txt
ENV PATH=/opt/venv/bin:$PATH
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY scripts/gen_proto.sh scripts/gen_proto.sh
COPY services/ services/
# Generated code from the one command, with the same protobuf the runtime has; grpcio-tools stays here.
RUN pip install -c /tmp/constraints.txt grpcio-tools \
 && PYTHON=python bash scripts/gen_proto.sh \
 && pip install -c /tmp/constraints.txt ".[teacher]" \
 && pip uninstall -y grpcio-tools \
 && python -c "import vllm, eopd_teacher.engines.vllm_engine, eopd.v1.teacher_pb2"

# ---- runtime: the base image plus the small venv ----
FROM ${VLLM_IMAGE}
ARG UID=10001
LABEL org.opencontainers.image.title="eopd-teacher" \
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
    HF_HOME=/cache/hf \
    EOPD_CACHE_DIR=/cache \
    EOPD_TEACHER_HOST=0.0.0.0 \
    EOPD_TEACHER_GRPC_PORT=50051 \
    EOPD_TEACHER_HTTP_PORT=8000 \
    EOPD_TEACHER_HTTP_PROBE_PORT=8001 \
    EOPD_TEACHER_ENGINE=vllm \
    EOPD_TEACHER_DTYPE=bfloat16 \
    EOPD_TEACHER_DEVICE=cuda
USER ${UID}:${UID}
WORKDIR /home/eopd
EXPOSE 50051 8000 8001
# Loading a large teacher takes minutes: a long start period, then gRPC health every 15 s.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "/opt/eopd/healthcheck.py"]
ENTRYPOINT ["eopd-teacher"]
CMD ["serve"]
