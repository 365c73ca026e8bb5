"""ckptctl: consolidate, reshard and verify sharded LLM training checkpoints.

The package holds the vocabulary (layout model, plan schema: pure) and every side effect
(format readers and writers, storage, the executor, the CLI). Policy lives in ``planners``.
"""

__version__ = "0.1.0"
