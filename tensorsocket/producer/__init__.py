"""TensorProducer, the publishing side of the ring, split by job (one file each):

- ``tensor_producer``: the public class, which composes the parts below.
- ``settings``: the constructor's arguments resolved (argument, environment, default)
  and checked.
- ``sizing``: the late-joiner window and the ring's slot size and count (first batch).
- ``ring_maker``: the ring created under the producer's segment name (GPU or host).
- ``epochs``: the data loader's passes, one per epoch.
- ``gate``: waiting for consumers before a batch (min_consumers, start_grace).
- ``publisher``: an epoch run: each batch encoded, published, then yielded.
- ``sample_cache``: the decoded-sample cache (cache_bytes=): a DataLoader's rows kept
  during the first epoch, later epochs built from them.
- ``memory_room``: what the machine and the producer's memory cgroups leave (read
  before the cache is allocated).
- ``lifecycle``: the name lock, the secret, the control server, and the teardown.
- ``gpu_release``: a GPU ring's device memory freed once no consumer maps it.
- ``failure``: what the consumers are told of the error that ended the producer.
- ``stats``: the counters of ``TensorProducer.stats()``.
"""

from .tensor_producer import TensorProducer

__all__ = ["TensorProducer"]
