"""Supervised fine-tuning of DreamZero on LeRobot datasets (`dreamzero-train`; docs/training.md).

Modules: `schedule` (flow-matching training table and weights), `data` (dataset -> clips laid out as served),
`objective` (frozen encoders + teacher-forced joint video / action loss), `trainer` (AdamW loop, checkpoints,
resume, JSONL log), `cli` (the command line).
"""
