"""accelerate's file names for an FSDP model saved with ``FULL_STATE_DICT`` (model 0 and its
optimizer: ``save_fsdp_model`` / ``save_fsdp_optimizer``). Pure."""

MODEL = "pytorch_model_fsdp.bin"
OPTIMIZER = "optimizer.bin"
