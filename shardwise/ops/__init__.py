"""DeepSpeed's ``deepspeed.ops`` optimizer names, so ``from shardwise.ops.adam import FusedAdam``
works where a script said ``from deepspeed.ops.adam import FusedAdam``. Nothing here is a
compiled op: each name builds the matching torch (fused) optimizer."""
