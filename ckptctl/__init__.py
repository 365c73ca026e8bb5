"""ckptctl: consolidate, reshard and verify sharded LLM training checkpoints.

The package holds the vocabulary (layout model, plan schema: pure) and every side effect
(format readers and writers, storage, the executor, the CLI). Policy lives in ``planners``.
"""

__version__ = "0.1.0"

_TRAINING = ("save", "async_save", "load", "Checkpointer")


def __getattr__(name: str) -> object:
    """``ckptctl.save`` / ``async_save`` / ``load`` / ``Checkpointer`` (the training-loop API)
    import torch only when first used, so the CLI starts without it."""
    if name in _TRAINING:
        from ckptctl import training

        return getattr(training, name)
    raise AttributeError(f"module 'ckptctl' has no attribute {name!r}")
