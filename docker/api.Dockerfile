# The API image: no torch, no compiler. Runs migrations, then serves on :8000.
FROM python:3.11-slim
# distribution packages follow the base image's release:
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY migrations ./migrations
COPY worker/__init__.py ./worker/__init__.py
# this project from its own tree; pyproject.toml bounds its dependencies:
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[server]"
ENV OPTDRIFT_HOME=/data
EXPOSE 8000
CMD ["sh", "-c", "optdrift migrate && optdrift serve --host 0.0.0.0 --port 8000 --no-worker"]
