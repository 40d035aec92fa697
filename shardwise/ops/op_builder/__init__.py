"""DeepSpeed's ``deepspeed.ops.op_builder`` names that shardwise provides.

``AsyncIOBuilder().load().aio_handle(...)`` is how DeepSpeed code reaches its C++ async IO
op; here ``load()`` builds nothing and returns :mod:`shardwise.ops.aio`, whose
``aio_handle`` is the pure-Python :class:`~shardwise.io.aio_handle.AsyncIOHandle`;
``GDSBuilder().load().gds_handle`` is the same with GPUDirect Storage through kvikio.
"""
from .async_io import AsyncIOBuilder
from .gds import GDSBuilder

__all__ = ["AsyncIOBuilder", "GDSBuilder"]
