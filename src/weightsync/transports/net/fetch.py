"""A receiving host's end of the network transport: connect to the trainer, prove the
token, ask for a version (saying which one this host holds, so it may come as deltas), and
rebuild it chunk by chunk, each verified against the trainer's checksum before the version
is returned. The last verified version stays in memory as the next delta's base."""

from __future__ import annotations

import logging
import socket

import torch

from weightsync.core.errors import IntegrityError, SenderLostError, WeightSyncError
from weightsync.transports.delta.codec import KIND_NAMES, WHOLE, DeltaDecoder, header_problem
from weightsync.transports.net.handshake import prove_to_trainer
from weightsync.transports.net.packed import (
    PackedVersion,
    chunk_count,
    layout_fingerprint,
    parse_header,
    parse_metadata,
    parse_regions,
)
from weightsync.transports.net.wire import (
    CHUNK_BYTES,
    CHUNK_HEADER,
    ProtocolError,
    chunk_checksum,
    recv_exact,
    recv_frame,
    recv_into_exact,
    send_frame,
    split_address,
    tensor_view,
)

logger = logging.getLogger(__name__)

#: the largest version a host accepts (after the trainer proved the token)
MAX_VERSION_BYTES = 1 << 42


class VersionFetcher:
    """Fetches versions from one trainer session for this host (``name``: how the trainer
    logs it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.base: PackedVersion | None = None
        self.base_session: str | None = None
        self.last_kinds: dict[str, int] = {}
        self._decoder: DeltaDecoder | None = None
        self._spare: torch.Tensor | None = None  # the buffer of the base before last

    def fetch(self, address: str, token: str, want: int | None, timeout: float) -> PackedVersion:
        """Version ``want`` (None: the trainer's current one), verified. Raises
        ``SenderLostError`` if the trainer is unreachable or goes away mid-version,
        ``IntegrityError`` if a chunk fails its checksum, ``WeightSyncError`` if the
        trainer has no such version; the base is then unchanged."""
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise SenderLostError(f"host {self.name}: cannot reach the trainer at {address} "
                                  f"({exc}); is it running, and is that address reachable "
                                  f"from here?") from None
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                prove_to_trainer(sock, token, self.name)
                return self._receive(sock, address, want)
            except (ProtocolError, OSError) as exc:
                raise SenderLostError(
                    f"host {self.name}: the connection to the trainer at {address} broke "
                    f"during version {want if want is not None else '(current)'}: "
                    f"{type(exc).__name__}: {exc}; this host keeps serving the version it held"
                ) from None

    def _receive(self, sock: socket.socket, address: str, want: int | None) -> PackedVersion:
        base = self.base
        held = None if base is None else {"session": self.base_session, "version": base.version,
                                          "fingerprint": base.fingerprint}
        send_frame(sock, {"want": want, "base": held})
        header = recv_frame(sock)
        if "error" in header:
            raise WeightSyncError(f"host {self.name}: the trainer at {address} refused: "
                                  f"{header['error']}")
        version, session, entries, nbytes = parse_header(header, MAX_VERSION_BYTES)
        regions = parse_regions(header, entries)
        metadata = parse_metadata(header)
        based = header.get("base")
        if based is not None and (base is None or based != base.version
                                  or session != self.base_session
                                  or layout_fingerprint(entries, nbytes) != base.fingerprint):
            raise ProtocolError(f"the trainer encodes against version {based}, which this "
                                f"host does not hold")
        spare, self._spare = self._spare, None
        out = spare if spare is not None and spare.numel() == nbytes else \
            torch.empty(nbytes, dtype=torch.uint8)  # reused: no page faults of fresh memory
        kinds: dict[str, int] = {}
        for index in range(chunk_count(nbytes)):
            kind, size, checksum = CHUNK_HEADER.unpack(recv_exact(sock, CHUNK_HEADER.size))
            target = out[index * CHUNK_BYTES:(index + 1) * CHUNK_BYTES]
            has_base = based is not None and base is not None
            problem = header_problem(kind, size, target.numel(), has_base)
            if problem is not None:
                raise IntegrityError(f"host {self.name}: chunk {index} of version {version}: "
                                     f"{problem}; the version is refused before anything is "
                                     f"allocated for it, and this host keeps the one it held")
            name = KIND_NAMES[kind]
            kinds[name] = kinds.get(name, 0) + 1
            if kind == WHOLE:
                recv_into_exact(sock, tensor_view(target))
            elif base is not None:
                payload = torch.empty(size, dtype=torch.uint8)
                recv_into_exact(sock, tensor_view(payload))
                if self._decoder is None:
                    self._decoder = DeltaDecoder()
                try:
                    self._decoder.decode(kind, payload, base.chunk(index), target)
                except (ValueError, IntegrityError) as exc:
                    raise IntegrityError(f"host {self.name}: chunk {index} of version "
                                         f"{version} ({name}) does not decode: {exc}") from None
            if chunk_checksum(target) != checksum:
                send_frame(sock, {"error": f"chunk {index} failed its checksum"})
                raise IntegrityError(
                    f"host {self.name}: chunk {index} of version {version} (sent {name}) "
                    f"differs from the trainer's checksum; the version is refused and this "
                    f"host keeps the one it held")
        packed = PackedVersion(version, entries, out, regions=regions, metadata=metadata)
        if base is not None:
            self._spare = base.buffer  # callers are done with a version once they fetch again
        self.base, self.base_session, self.last_kinds = packed, session, kinds
        send_frame(sock, {"ok": version})
        logger.info("host %s received version %d (%d bytes, chunks %s)", self.name, version,
                    nbytes, kinds)
        return packed
