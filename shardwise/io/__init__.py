"""File IO shared by checkpoints and NVMe offload, in pure Python over PyTorch.

- ``checksums``: chunk-wise crc32 on a thread pool.
- ``pinned_ring``: a ring of (pinned) host buffers for device-to-host copies before a write.
- ``stream_writer``: writes tensors back to back with copy, crc and write overlapped, and
  Linux early writeback.
- ``read_pool``: chunk-parallel reads through per-thread file handles.
- ``swap_files``: one rank's named swap files for NVMe parameter offload (stage 3's
  ``FileShard`` and ZeRO-Inference's layer streaming).
"""
