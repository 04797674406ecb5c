"""The megatron backend (DESIGN.md §5): megatron-core GPTModel engines for Qwen3 dense shapes (GPU only).

`convert` (HF Qwen3 ⇄ Megatron state dicts) is pure torch and runs anywhere; `model` and `engine` import
megatron-core lazily (the `megatron` extra). `parallel`: process setup and this rank's TP/DP groups; `build`:
an HF checkpoint into this TP rank's GPTModel; `checkpoint_state`: the actor's save and load methods;
`expert_parallel`: the experts of a MoE actor over megatron's EP group (shard, gather, dispatcher) and
`expert_checkpoint` its optimizer state per EP rank.
"""
