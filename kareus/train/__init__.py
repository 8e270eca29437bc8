"""``mode=train``: real megatron-core training with an execution plan applied, measured and compared with
Megatron's own layout. Nothing here imports torch at import time; the planner stays importable without it."""
