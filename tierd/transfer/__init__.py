"""Copies between engine KV tensors and pool objects (CPU memcpy, CUDA kernels)."""
