# The DreamZero policy server for GPU machines and KubeRay clusters (docs/serving.md, "Kubernetes").
#
#   docker build -t dreamzero-serve:gpu .
#   docker run --gpus all -p 8000:8000 -v /data/models:/models:ro -v $PWD/gpu.yaml:/config/gpu.yaml:ro \
#       dreamzero-serve:gpu serve run /config/gpu.yaml      # a config with model_path: /models/...
#
# Without arguments it runs `serve run serve_config.yaml`: the shipped config, i.e. the small embedded default on CPU.
# No weights are baked in: checkpoints (and the umt5-xxl tokenizer) are mounted, at /models by convention. The only
# weights inside are the 11 MB embedded default the shipped config serves, package data of dreamzero/.
#
# Base image: Ray's own GPU image of exactly the Ray that pyproject.toml pins (ray[serve]==2.60.*), Python 3.11 (the
# version the test suite runs on). Chosen over a bare nvidia/cuda runtime image because
#   - it is built on NVIDIA's CUDA image, so the NVIDIA container runtime exposes the GPUs and driver to it;
#   - KubeRay starts every pod of a RayService with `ray start` and probes it with bash + wget, all present here, and
#     head and workers then run the one Ray version the project is tested on;
#   - it already runs as the unprivileged user `ray` (uid 1000, group users) with a writable home, where Ray keeps
#     its session files and the tiny model of `model_path: null` is cached.
# torch is not in the base: pip takes it from PyPI, whose Linux x86_64 wheel is the CUDA build (it carries its own
# CUDA libraries; the node's driver must be recent enough for them), pinned by a pip constraint to the minor version
# the GPU check runs with (TORCH_VERSION: torch 2.11, the GPU box's; scripts/gpu-requirements.txt), so an image built
# later gets the torch the figures in docs/benchmarks.md were measured with, not whatever PyPI holds that day.
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.11.*

USER ray
RUN mkdir -p /home/ray/dreamzero-serve
WORKDIR /home/ray/dreamzero-serve

# The sources pip needs, and nothing else (.dockerignore keeps caches, tests and stray weights out of the context).
COPY --chown=ray:users pyproject.toml README.md serve_config.yaml ./
COPY --chown=ray:users clients/ clients/
COPY --chown=ray:users dreamzero/ dreamzero/
COPY --chown=ray:users serve_graph/ serve_graph/
COPY --chown=ray:users deployments/ deployments/
COPY --chown=ray:users eval/ eval/

# As scripts/install.sh installs it, without what only tests and simulators need (the dev, sim and LIBERO extras):
# the client packages the server uses and the project, editable, so the code serve run imports is this tree; torch held to
# TORCH_VERSION by PIP_CONSTRAINT (pip reads it for every install in this image).
RUN echo "torch==${TORCH_VERSION}" > /home/ray/torch-constraint.txt
ENV PIP_CONSTRAINT=/home/ray/torch-constraint.txt
RUN python -m pip install --no-cache-dir -e "./clients/dreamzero-client[http,zmq]" -e ./clients/dreamzero-droid -e . \
    && python -c "import torch, ray; assert torch.version.cuda, 'CPU-only torch'; print(torch.__version__, ray.__version__)"

EXPOSE 8000
# On KubeRay this command is replaced by `ray start ...`; the RayService's serveConfigV2 carries the application.
CMD ["serve", "run", "serve_config.yaml"]
