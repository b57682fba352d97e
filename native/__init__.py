"""CUDA/HIP sources of tierd's batched gather/scatter kernels (built by tierd_client.native)."""
