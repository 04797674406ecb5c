"""Weight sync actor → rollout (DESIGN.md §5): `torch` (torch.distributed broadcast, gloo/NCCL)."""
