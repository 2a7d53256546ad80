"""What the network transport's MACs and per-host credentials keep out: a relay on the path
(no token) that rewrites or moves chunks, a server posing as the trainer to another, a
trickling or slow trainer past the fetch's one deadline, a header no host can hold, and a
damaged delta base (the version comes whole at once)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch
from net_relay import Chunk, Relay

from weightsync.core.errors import IntegrityError, SenderLostError, WeightSyncTimeoutError
from weightsync.transports.net.fetch import VersionFetcher
from weightsync.transports.net.handshake import accept_peer, host_credential
from weightsync.transports.net.packed import PackedVersion, pack
from weightsync.transports.net.publisher import VersionPublisher
from weightsync.transports.net.wire import CHUNK_BYTES, CHUNK_HEADER, chunk_checksum

pytest.importorskip("zstandard")

TOKEN = "the-trainers-secret"
CRED = host_credential(TOKEN, "host-a")


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Exactly two whole chunks in float32 (so two chunks may trade places)."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2 * CHUNK_BYTES // 4, generator=gen)}


@pytest.fixture
def publisher():
    pub = VersionPublisher("127.0.0.1:0", TOKEN, timeout=10, delta=True)
    yield pub
    pub.close()


def _rewrite_four_floats(chunks: list[Chunk]) -> list[Chunk]:
    """Change 4 floats of chunk 1 and recompute its public checksum."""
    head, tag, payload = chunks[1]
    kind, size, _ = CHUNK_HEADER.unpack(head)
    changed = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    changed.view(torch.float32)[100:104] = 7.0
    head = CHUNK_HEADER.pack(kind, size, chunk_checksum(changed))
    return [chunks[0], (head, tag, changed.numpy().tobytes())]


def _swap(chunks: list[Chunk]) -> list[Chunk]:
    return [chunks[1], chunks[0]]


def _replay_first(chunks: list[Chunk]) -> list[Chunk]:
    return [chunks[0], chunks[0]]


def _cut_short(chunks: list[Chunk]) -> list[Chunk]:
    """Chunk 0 loses 1000 bytes; what follows arrives as is."""
    head, tag, payload = chunks[0]
    return [(head, tag, payload[:-1000]), chunks[1]]


@pytest.mark.parametrize("tamper", [_rewrite_four_floats, _swap, _replay_first, _cut_short],
                         ids=["rewrite", "swap", "replay", "truncate"])
def test_a_relay_without_the_token_cannot_change_a_version(publisher: VersionPublisher, tamper):
    """The relay forwards the handshake untouched, then changes the chunks: the host refuses
    the version before returning it, keeps its base, and the trainer hears of it."""
    fetcher = VersionFetcher("host-a")
    w0 = _weights(0)
    publisher.publish(pack(w0, 0))
    assert torch.equal(fetcher.fetch(publisher.address, CRED, None, 10).tensors()["w"], w0["w"])
    publisher.publish(pack(_weights(1), 1))
    relay = Relay(publisher.address, tamper)
    try:
        with pytest.raises(IntegrityError, match="version 1"):
            VersionFetcher("host-a").fetch(relay.address, CRED, 1, 10)
    finally:
        relay.close()
    assert relay.tampered == 1
    streams = publisher.wait_streams(1, 1, 5)
    assert streams and streams[0].error is not None  # the trainer does not report success
    assert fetcher.base is not None and fetcher.base.version == 0


def test_an_untouched_relay_changes_nothing(publisher: VersionPublisher):
    """The same relay passing the chunks on as they are: the version arrives exact (so the
    failures above are the tampering's)."""
    publisher.publish(pack(_weights(1), 1))
    relay = Relay(publisher.address, lambda chunks: chunks)
    try:
        got = VersionFetcher("host-a").fetch(relay.address, CRED, 1, 10)
    finally:
        relay.close()
    assert relay.tampered == 1 and torch.equal(got.tensors()["w"], _weights(1)["w"])


def test_a_server_cannot_pose_as_the_trainer_to_another_server(publisher: VersionPublisher):
    """Each server's host gets its own credential: server 1, holding its own, listens where
    server 0 expects the trainer and cannot prove server 0's credential."""
    mine, theirs = host_credential(TOKEN, "server0"), host_credential(TOKEN, "server1")
    assert mine != theirs and TOKEN not in mine
    with socket.create_server(("127.0.0.1", 0)) as fake:
        address = f"127.0.0.1:{fake.getsockname()[1]}"
        refused: list[BaseException] = []

        def impostor() -> None:
            conn, _ = fake.accept()
            with conn:
                try:  # the best server 1 can do: its own credential as the trainer's secret
                    accept_peer(conn, theirs)
                except Exception as exc:
                    refused.append(exc)

        thread = threading.Thread(target=impostor)
        thread.start()
        with pytest.raises(SenderLostError, match="credential|refused"):
            VersionFetcher("server0").fetch(address, mine, None, 10)
        thread.join(10)
    assert refused
    # the real trainer proves it, and server 1's credential works only as server 1
    publisher.publish(pack(_weights(0), 0))
    VersionFetcher("server0").fetch(publisher.address, mine, None, 10)
    forged = "server0." + theirs.partition(".")[2]
    with pytest.raises(SenderLostError):
        VersionFetcher("server1").fetch(publisher.address, forged, None, 10)


def test_each_server_of_the_trainer_engine_gets_its_own_credential():
    """The vLLM trainer engine hands every server a credential of its own (today's code
    handed all of them the session's one token)."""
    pytest.importorskip("vllm")
    from weightsync.integrations.vllm.backend import (
        WeightSyncTrainerEngine,
        WeightSyncTrainerInitInfo,
    )

    class Recorder:
        def __init__(self) -> None:
            self.info: dict[str, Any] = {}

        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            self.info = dict(init_info)
            VersionFetcher("fake").fetch(init_info["address"], init_info["token"], None, 10)

        def start_weight_update(self) -> None:  # the label of the version loaded at init
            pass

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            pass

    clients = [Recorder(), Recorder()]
    engine = WeightSyncTrainerEngine.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, address="127.0.0.1:0", timeout=10), client=clients,  # type: ignore[arg-type]
        source=list(_weights(0).items()))  # type: ignore[arg-type]
    try:
        tokens = [c.info["token"] for c in clients]
        assert tokens[0] != tokens[1]
        assert engine._token not in tokens  # the session's secret never leaves the trainer
    finally:
        engine.shutdown()


def test_a_trickling_trainer_ends_the_fetch_at_its_deadline(publisher: VersionPublisher,
                                                            monkeypatch: pytest.MonkeyPatch):
    """A trainer (or a link) that sends a byte now and then: the fetch gives up at its one
    deadline from the call's start, not per read."""
    original = VersionPublisher._send_chunk

    def trickle(conn, seal, packed, index, kind, payload, figures):
        slow = SlowSocket(conn)
        original(slow, seal, packed, index, kind, payload, figures)

    monkeypatch.setattr(VersionPublisher, "_send_chunk", staticmethod(trickle))
    publisher.publish(pack(_weights(0), 0))
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError, match="deadline of 2"):
        VersionFetcher("host-a").fetch(publisher.address, CRED, None, 2.0)
    assert time.monotonic() - started < 3.5


class SlowSocket:
    """A socket whose ``sendall`` drips 64 bytes every 0.05 s (stops once the peer leaves)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), 64):
            self.sock.sendall(view[at:at + 64])
            time.sleep(0.05)


def test_a_slow_link_ends_the_fetch_at_its_deadline(publisher: VersionPublisher):
    """Behind a 128 KiB/s link a 32 MiB version cannot arrive in 2 s: the fetch says so at
    its deadline."""
    publisher.publish(pack(_weights(0), 0))
    relay = Relay(publisher.address, rate=128 * 1024)
    try:
        started = time.monotonic()
        with pytest.raises(WeightSyncTimeoutError, match="did not arrive within"):
            VersionFetcher("host-a").fetch(relay.address, CRED, None, 2.0)
        assert time.monotonic() - started < 3.5
    finally:
        relay.close()


def test_a_header_no_host_can_hold_is_refused_before_allocating(publisher: VersionPublisher,
                                                                monkeypatch: pytest.MonkeyPatch):
    """A token holder announcing 2 TiB: a typed error naming the sizes, not the allocator's."""
    header = PackedVersion.header

    def huge(self: PackedVersion, session: str) -> dict[str, Any]:
        out = header(self, session)
        out["nbytes"] = 2 << 40
        return out

    monkeypatch.setattr(PackedVersion, "header", huge)
    monkeypatch.setattr("weightsync.transports.net.fetch.host_memory", lambda: 1 << 40)
    publisher.publish(pack(_weights(0), 0))
    with pytest.raises(IntegrityError, match="more than this host's"):
        VersionFetcher("host-a").fetch(publisher.address, CRED, None, 10)


def test_a_damaged_delta_base_gets_the_version_whole_at_once(publisher: VersionPublisher,
                                                             caplog: pytest.LogCaptureFixture):
    """One flipped byte in the host's base: the delta does not rebuild the trainer's chunk,
    so the same fetch asks for the version whole and returns it exact; the trainer logs and
    counts why that host got it whole."""
    fetcher = VersionFetcher("host-a")
    w0 = _weights(0)
    publisher.publish(pack(w0, 0))
    fetcher.fetch(publisher.address, CRED, None, 10)
    assert fetcher.base is not None
    fetcher.base.buffer[12345] ^= 0x10
    w1 = {"w": w0["w"].clone()}
    w1["w"][:10] += 1.0
    publisher.publish(pack(w1, 1))
    with caplog.at_level("INFO"):
        got = fetcher.fetch(publisher.address, CRED, 1, 10)
    assert torch.equal(got.tensors()["w"], w1["w"])
    assert fetcher.whole_refetches == 1 and fetcher.last_kinds == {"whole": 2}
    streams = publisher.wait_streams(1, 2, 5)
    assert [s.error is None for s in streams] == [False, True]
    assert "did not rebuild" in (streams[1].whole_reason or "")
    assert any("gets version 1 whole" in r.getMessage() and "host-a" in r.getMessage()
               for r in caplog.records)


def test_a_new_host_is_told_why_it_gets_the_version_whole(publisher: VersionPublisher):
    publisher.publish(pack(_weights(0), 0))
    fetcher = VersionFetcher("host-a")
    fetcher.fetch(publisher.address, CRED, None, 10)
    assert fetcher.last_whole_reason is not None and "holds no version" in fetcher.last_whole_reason
    assert "holds no version" in (publisher.wait_streams(0, 1, 5)[0].whole_reason or "")
