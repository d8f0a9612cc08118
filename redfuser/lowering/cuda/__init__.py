"""Per-target lowering: threads per block, shared memory and SMs (CUDA) behind ``backends``."""
