"""The model runner: a step plan to tensors to logits to tokens, and its decode-step strategies (eager, fused, compiled)."""
