"""GPU memory of the engines.

- `estimates`: memory from model shapes and step sizes (pure arithmetic; the `--dry-run` memory plan and
  the default micro-batch budget).
- `peaks`: peak memory of a server child per phase of the step.
- `residency`: offload/onload of an engine's parameters, gradients and optimizer state (torch engines;
  the megatron backend's own is `engines/megatron/residency.py`).
"""
