"""The data path: reading and writing batches in the ring (delivery, batch structure, dtypes),
re-batching, epochs, sample ids, resume state, ring diagnosis, segments, GPU status."""
