# The GPU worker image: CUDA toolkit (nvcc for the ninja builds) + torch. One container per GPU.
FROM nvidia/cuda:12.8.1-devel-ubuntu22.04
# bubblewrap: the sandbox every build and kernel host runs in (worker/sandbox.py); util-linux has
# setpriv. Without them the worker refuses verify runs
# (docs/security/SANDBOX.md, "The sandbox").
# distribution packages follow the base image's release:
# python3.11-dev: Python.h for optdrift's compiled harness (worker/engine/harness.py), built once
# per image and GPU at the first kernel host and kept under /data/harness.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
        python3.11-dev python3-pip git ninja-build bubblewrap util-linux && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /venv
ENV PATH=/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.8.0 --index-url https://download.pytorch.org/whl/cu128
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY migrations ./migrations
COPY worker ./worker
COPY csrc ./csrc
# this project from its own tree; pyproject.toml bounds its dependencies:
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[worker]"
# The worker runs as an unprivileged user: bubblewrap then maps the sandbox's uid 65534 to it
# through a user namespace, and submitted code never runs as root inside the container. The user
# is named `optdrift`, the default OPTDRIFT_WORKER_USER: a container started as root instead (which
# bwrap's privileged mode needs CAP_SYS_ADMIN for) has each worker become it at start and keep root
# only to launch the box (worker/sandbox/privilege.py, docs/DEPLOY.md).
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin optdrift \
    && mkdir -p /data/builds && chown -R optdrift:optdrift /data
ENV OPTDRIFT_HOME=/data OPTDRIFT_HARNESS_CACHE=/data/harness
# numeric: the uid the compose file's token provisioning and bubblewrap's mapping expect
USER 10001:10001
CMD ["optdrift", "worker"]
