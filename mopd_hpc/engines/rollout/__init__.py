"""Rollout servers: one HTTP surface (SGLang 0.5.23's RL subset) whatever the backend (DESIGN.md §5).

- `protocol`: request/response records shared by server, client and controller (no torch import).
- `client`: `RolloutClient`, the trainer's asyncio client.
- `sampling`, `rows`, `hf_engine` (its static decoder in `hf_static`), `scheduler`, `hf_server`: the hf backend (transformers model, CPU or GPU);
  run it with `python -m mopd_hpc.engines.rollout.hf_server --model PATH --port N`.
"""
