"""The engine layer: requests, scheduling, step inputs, the speculative step (eager or CUDA graphs), output
processing, the overlap loop, the tensor-parallel executor and the loaded-model runtime."""
