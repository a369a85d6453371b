# redsrv's image: the reducers, and the workers when built with a framework (docs/operations.md,
# "Kubernetes"; examples/k8s/ uses both).
#
#   docker build -t redsrv:0.1.0 .                                               # reducers (+ metrics)
#   docker build -t redsrv-torch:0.1.0 --build-arg EXTRAS=metrics,torch .        # workers, PyTorch CPU
#   docker build -t redsrv-torch-cuda:0.1.0 --build-arg EXTRAS=metrics,torch \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .         # workers, PyTorch CUDA
#
# Everything is installed at build time: a pod starts with nothing to download.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
# A C compiler for the compiled data plane (native/plane.c); strict: an image without it would run
# the slower Python plane with only a warning in the build log.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV REDSRV_NATIVE_STRICT=1
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY native native
COPY api api
COPY core core
COPY adapters adapters
COPY cli cli
COPY benchmarks benchmarks
COPY examples examples
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON}-slim
ARG EXTRAS=metrics
# torch from its CPU index by default: from PyPI a bare `torch` pulls gigabytes of CUDA packages.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" "$(ls /wheels/redsrv-*.whl)[${EXTRAS}]" \
    && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin redsrv
# Non-root, by number: Pod Security "restricted" checks runAsNonRoot against a numeric user.
USER 10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
EXPOSE 29600 9400
ENTRYPOINT ["redsrv"]
CMD ["reducer", "--host", "0.0.0.0"]
