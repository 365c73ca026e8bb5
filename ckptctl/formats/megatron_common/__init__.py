"""What Megatron's two storage forms -- the legacy rank files (``megatron``) and megatron-core's
``torch_dist`` -- share, and what formats holding a Megatron model (DCP saves inside Megatron
iteration directories, verl's Megatron actor) read of Megatron: ``args`` and the model they
describe, the rank grid, each rank's parameters, the distributed optimizer's buffers, the
iteration directories, and what every Megatron target file keeps and carries."""
