"""PyTorch Distributed Checkpoint's container, shared by every format stored in it (plain DCP
saves of FSDP2 and torchtitan, megatron-core's ``torch_dist``): the ``.metadata`` pickle (read by
an allow-listing unpickler, written without torch), the ``torch.save`` records inside
``.distcp`` files read by byte range, and a checkpoint reader over them."""
