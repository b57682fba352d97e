"""Host memory: segments, slab allocator, object index and eviction."""
