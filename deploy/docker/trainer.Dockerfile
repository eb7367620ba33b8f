# syntax=docker/dockerfile:1
# The trainer: the DeepSpeed learner (`eopd-train`, launched by torchrun) and the rollout worker
# (`eopd-rollout`), CUDA. The build stage compiles DeepSpeed's fused Adam with nvcc; the runtime
# stage is the much smaller CUDA runtime image plus the venv.
#
#   docker build -f deploy/docker/trainer.Dockerfile -t eopd-trainer:0.1.0 .
#
# No model weights inside: the student comes from /models (mounted) and checkpoints and published
# weights go to /shared (a volume shared by the learner and the rollout workers).
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# ---- build ----
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# GPU architectures DeepSpeed's ops are compiled for (A100, A10/3090, L4/4090, H100).
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}
# Ubuntu's packages follow the pinned base image's release; exact Ubuntu patch versions are not
# pinned because the archive drops them (the Python packages are pinned below).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
# hadolint ignore=DL3059
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
# DeepSpeed with its fused Adam prebuilt (no JIT compilation on the GPU nodes, which have no nvcc).
# Its setup.py imports torch to compile the op, so it is built WITHOUT build isolation (an isolated
# build env has no torch, and pip would silently install DeepSpeed with no op compiled) after the
# pinned build tools. The build stage has nvcc but no GPU, where DeepSpeed's accelerator detection
# would pick its CPU accelerator: DS_ACCELERATOR=cuda fixes the choice. The build FAILS unless the
# installed DeepSpeed reports fused_adam as prebuilt for CUDA.
RUN pip install -c deploy/docker/constraints.txt setuptools wheel ninja packaging \
 && DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 DS_BUILD_UTILS=1 \
    pip install --no-build-isolation -c deploy/docker/constraints.txt deepspeed \
 && DS_ACCELERATOR=cuda python -c "from deepspeed.git_version_info import installed_ops, accelerator_name; \
assert accelerator_name == 'cuda', accelerator_name; \
assert installed_ops['fused_adam'] is True, 'DeepSpeed fused_adam was not prebuilt: %r' % installed_ops"
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY scripts/gen_proto.sh scripts/gen_proto.sh
COPY services/ services/
RUN pip install -c deploy/docker/constraints.txt grpcio-tools \
 && PYTHON=python bash scripts/gen_proto.sh \
 && pip install -c deploy/docker/constraints.txt ".[teacher,trainer]" \
 && pip uninstall -y grpcio-tools

# ---- runtime ----
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU}
ARG UID=10001
LABEL org.opencontainers.image.title="eopd-trainer" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid "${UID}" eopd \
 && useradd --uid "${UID}" --gid eopd --create-home --home-dir /home/eopd --shell /usr/sbin/nologin eopd \
 && mkdir -p /models /cache /shared /opt/eopd \
 && chown eopd:eopd /models /cache /shared
COPY --from=build /opt/venv /opt/venv
COPY configs/ /opt/eopd/configs/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/hf \
    EOPD_CACHE_DIR=/cache
USER ${UID}:${UID}
WORKDIR /home/eopd
# No HEALTHCHECK: the learner and the rollout worker serve nothing to probe (a check that always
# passes would lie). They exit non-zero on failure and are restarted (compose `restart:`, the
# Job's backoffLimit, the Deployment); progress is watched in TensorBoard / Prometheus.
HEALTHCHECK NONE
CMD ["eopd", "--help"]
