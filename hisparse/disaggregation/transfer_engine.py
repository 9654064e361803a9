"""Mooncake's Transfer Engine as the engine uses it: register pools once, then write runs of rows into a peer's.

The prefill side writes, the decode side only registers the pools it receives into and names them by
address: one-sided writes, as in SGLang's Mooncake backend, so the decode side spends nothing while its
rows arrive. Peers find each other by session id ("host:rpc_port", Mooncake's P2P handshake, no metadata
server); the protocol is TCP here and RDMA on a cluster (`MC_PROTOCOL`, or `protocol`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

from hisparse.disaggregation.row_transfer import PoolSpec


class TransferError(RuntimeError):
    pass


def _mooncake():
    """The Mooncake module, or one line saying how to get it."""
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every handshake at INFO on stderr
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:
        hint = ("apt-get install libibverbs1" if "libibverbs" in str(error)
                else "pip install 'hisparse[pd]' (mooncake-transfer-engine-non-cuda)")
        raise TransferError(f"Mooncake's transfer engine is not available ({error}); {hint}") from None
    return TransferEngine


class KVTransferEngine:
    """One process's transfer engine. `write` is safe from any thread (calls are serialised)."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str | None = None) -> None:
        self._engine = _mooncake()()
        self.protocol = protocol or os.environ.get("MC_PROTOCOL", "tcp")
        if self._engine.initialize(hostname, "P2PHANDSHAKE", self.protocol, "") != 0:
            raise TransferError(f"Mooncake could not start on {hostname} over {self.protocol}")
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []  # kept alive while registered
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> int:
        """Make a contiguous tensor's memory a source or destination of transfers; returns its address."""
        if not tensor.is_contiguous():
            raise ValueError("only a contiguous tensor can be registered for transfers")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes and self._engine.register_memory(tensor.data_ptr(), nbytes) != 0:
            raise TransferError(f"Mooncake could not register {nbytes} bytes at {tensor.data_ptr():#x}")
        self._registered.append(tensor)
        return tensor.data_ptr()

    def register_pools(self, pools: list[tuple[str, torch.Tensor]]) -> list[PoolSpec]:
        """Register an engine's named row pools (`LLMEngine.row_pools`); returns how a peer addresses them."""
        for _, pool in pools:
            self.register(pool)
        return [PoolSpec.of(name, pool) for name, pool in pools]

    def write(self, session_id: str, sources: Sequence[int], destinations: Sequence[int],
              lengths: Sequence[int]) -> None:
        """Copy each (source, length) of this process's registered memory to the peer's destination; returns
        once the peer's memory holds them all, raises TransferError when any failed (peer gone, bad address)."""
        if not lengths:
            return
        with self._lock:
            status = self._engine.batch_transfer_sync_write(session_id, list(sources), list(destinations),
                                                            list(lengths))
        if status != 0:
            raise TransferError(f"the transfer of {sum(lengths)} bytes to {session_id} failed (Mooncake status "
                                f"{status}): the peer is gone or its memory is not registered")
