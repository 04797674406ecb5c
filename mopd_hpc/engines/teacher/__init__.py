"""The teachers' scoring servers (DESIGN.md §5) and their clients.

- `process`: one teacher child — build its scoring engine, listen, publish its endpoint (`serve`).
- `http_app`: the HTTP routes over a scoring engine (`TeacherServer`: /health, /score, /offload, /onload).
- `score_frames`: the /score request and answer as binary frames (`engines/frames/`).
- `greedy_generate`: the /generate_greedy route and request of the run's evaluation.
- `tensor_parallel`: a TP > 1 replica's leader and followers.
- `client`: `TeacherClient`, the trainer's asyncio client of one server; `replica_pool`: one teacher's
  replicas as one client, rows balanced by tokens.
"""
