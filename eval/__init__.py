"""DROID simulation evaluation: the env contract, the runner, policy links, simulator adapters, recording, reports.

Entry point: `dreamzero-eval` (eval.cli:main). See docs/evaluation.md.
"""
