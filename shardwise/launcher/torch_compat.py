"""Fixes for torch's elastic agent on platforms it does not quite support yet (Windows).

Each patch is applied once, only in the launcher's/agent's own process, and leaves torch's
behaviour unchanged where the problem does not arise.
"""
from __future__ import annotations

import os
import sys

from .worker import libuv_respecting_store


def respect_use_libuv() -> None:
    """Make the agent's rendezvous stores obey USE_LIBUV=0.

    torch's static and c10d rendezvous (and the c10d handler's shared store) create
    ``TCPStore(...)`` without ``use_libuv``, i.e. with libuv, which Windows builds of torch
    lack ("use_libuv was requested but PyTorch was built without libuv support"): torchrun
    cannot start on Windows. Workers get the same fix from ``worker.py``.
    """
    from torch.distributed.elastic.rendezvous import (c10d_rendezvous_backend,
                                                      dynamic_rendezvous, static_tcp_rendezvous)
    for module in (static_tcp_rendezvous, c10d_rendezvous_backend):
        if not hasattr(module.TCPStore, "__wrapped__"):
            module.TCPStore = libuv_respecting_store(module.TCPStore)
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    original = getattr(handler, "_create_tcp_store_server", None)
    if original is None or hasattr(original, "__wrapped__"):
        return

    def create_tcp_store_server(self, *args, **kwargs):
        if os.environ.get("USE_LIBUV") != "0":
            return original(self, *args, **kwargs)
        # It calls torch.distributed.TCPStore by attribute: swap it for this call only.
        import torch.distributed as dist
        real = dist.TCPStore
        dist.TCPStore = libuv_respecting_store(real)
        try:
            return original(self, *args, **kwargs)
        finally:
            dist.TCPStore = real

    create_tcp_store_server.__wrapped__ = original
    handler._create_tcp_store_server = create_tcp_store_server


def make_worker_stop_portable() -> None:
    """On Windows, let the agent stop workers even where CTRL_C_EVENT cannot be delivered.

    torch's agent stops a Windows worker with ``send_signal(CTRL_C_EVENT)``, which only
    reaches processes sharing a console process group and otherwise raises (SystemError /
    OSError); the agent then dies mid-shutdown and the worker's exit code is lost. Falling
    back to TerminateProcess (``Popen.kill``) keeps the agent's orderly failure path.
    """
    if not sys.platform.startswith("win"):
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    handler_class = subprocess_handler.SubprocessHandler
    original = handler_class.close
    if getattr(original, "_shardwise_portable", False):
        return

    def close(self, death_sig=None):
        try:
            original(self, death_sig)
        except (OSError, SystemError, ValueError):
            if self.proc.poll() is None:
                self.proc.kill()
            for stream in (self._stdout, self._stderr):
                if stream:
                    stream.close()

    close._shardwise_portable = True
    handler_class.close = close
