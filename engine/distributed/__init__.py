"""Running one model over several ranks (issue 49): a communicator (comm.py: the interface, the
CPU ranks in threads; nccl.py: NCCL through CuPy), the sharding of a GGUF's tensors by rank
(shard.py), tensor parallelism and the layer split on the numpy backend (tp.py), and the
vocabulary-parallel LM head's small collectives (vocab.py). docs/multi-gpu.md is the design."""
