"""``deepspeed.launcher.runner``: the names ``accelerate launch --use_deepspeed`` imports.

Single-node ``accelerate launch`` only reads ``DEEPSPEED_ENVIRONMENT_NAME``; multi-node it
would start DeepSpeed's own ``deepspeed`` CLI, which shardwise's ``shardwise`` launcher
replaces (same flags): see docs/integrations.md."""
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
"""File of extra environment variables DeepSpeed's multi-node runner exports (name only)."""
