# The GPU worker image: CUDA toolkit (nvcc for the ninja builds) + torch. One container per GPU.
FROM nvidia/cuda:12.8.1-devel-ubuntu22.04
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
        python3-pip git ninja-build && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /venv
ENV PATH=/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.8.0 --index-url https://download.pytorch.org/whl/cu128
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
COPY csrc ./csrc
RUN pip install --no-cache-dir ".[worker]"
ENV OPTDRIFT_HOME=/data
CMD ["optdrift", "worker"]
