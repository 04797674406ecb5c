"""The torch backend (DESIGN.md §5): transformers causal LMs, CPU or GPU.

- `engine`: the actor's train engine (`TorchTrainEngine`); `checkpoint_state`: its save and load methods.
- `scoring`: a teacher's or the reference model's forward-only engine (`TorchScoringEngine`).
- `hf_model`: loading a checkpoint and the response-position forward pass both engines run.
- `ddp`: the train engine's model under torch DistributedDataParallel (data parallel > 1).
"""
