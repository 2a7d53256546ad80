"""The network transport over loopback TCP: a version streamed whole, then as deltas
against the version the host holds; every chunk verified; only hosts that prove the
token are served; a trainer gone mid-version is a named error and leaves the base as is."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from weightsync.core.errors import IntegrityError, SenderLostError, WeightSyncError
from weightsync.transports.local.auth import HandshakeError
from weightsync.transports.net.fetch import VersionFetcher
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.packed import chunk_digest, pack
from weightsync.transports.net.publisher import VersionPublisher
from weightsync.transports.net.wire import CHUNK_BYTES

pytest.importorskip("zstandard")

#: what the trainer of "secret-token" hands the host named "host-b"
CRED = host_credential("secret-token", "host-b")


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(3 * CHUNK_BYTES // 4 + 123, generator=gen),  # 2 chunks in bf16
            "small": torch.randn(7, 5, generator=gen), "steps": torch.arange(4)}


def _step(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in weights.items()}
    out["big"][:1000] += 1.0  # one chunk changes
    return out


@pytest.fixture
def publisher():
    pub = VersionPublisher("127.0.0.1:0", "secret-token", timeout=10, delta=True)
    yield pub
    pub.close()


def _equal(packed, weights, dtype=torch.bfloat16) -> None:
    got = packed.tensors()
    for name, tensor in weights.items():
        want = tensor.to(dtype) if tensor.is_floating_point() else tensor
        assert torch.equal(got[name], want), name


def test_whole_then_delta_versions_arrive_exact(publisher: VersionPublisher):
    fetcher = VersionFetcher("host-b")
    w0 = _weights()
    publisher.publish(pack(w0, 0, torch.bfloat16))
    _equal(fetcher.fetch(publisher.address, CRED, None, 10), w0)
    assert fetcher.last_kinds == {"whole": 2}
    first = publisher.wait_streams(0, 1, 5)[0]
    assert first.error is None and first.delta_chunks == 0 and first.wire_bytes > CHUNK_BYTES
    w1 = _step(w0)
    publisher.publish(pack(w1, 1, torch.bfloat16))
    _equal(fetcher.fetch(publisher.address, CRED, 1, 10), w1)
    figures = publisher.wait_streams(1, 1, 5)[0]
    assert figures.delta_chunks == 2 and figures.wire_bytes < 20_000, figures
    assert fetcher.last_kinds.get("whole", 0) == 0
    with pytest.raises(WeightSyncError, match="has no version 7"):
        fetcher.fetch(publisher.address, CRED, 7, 10)


def test_figures_settle_waits_for_a_verdict_still_being_read(
        publisher: VersionPublisher, monkeypatch: pytest.MonkeyPatch):
    """A host sends its verdict and goes on to load: the trainer can hear of the load before
    the stream's thread has read that verdict. ``figures(v, settle=...)`` waits for every
    stream of ``v`` that began; without it the stream is missing."""
    from weightsync.transports.net import publisher as publisher_module

    read, release = publisher_module.recv_frame, threading.Event()

    def late_verdict(conn, *args, **kwargs):
        frame = read(conn, *args, **kwargs)
        if "ok" in frame:
            release.wait(10)  # the stream's thread is late to read the host's verdict
        return frame

    monkeypatch.setattr(publisher_module, "recv_frame", late_verdict)
    publisher.publish(pack(_weights(), 0, torch.bfloat16))
    VersionFetcher("host-b").fetch(publisher.address, CRED, None, 10)
    assert publisher.figures(0) == []  # the verdict is not read yet
    threading.Timer(0.3, release.set).start()
    settled = publisher.figures(0, settle=5.0)
    assert len(settled) == 1 and settled[0].chunks == 2 and settled[0].error is None


def test_a_host_without_the_base_gets_whole_chunks(publisher: VersionPublisher):
    publisher.publish(pack(_weights(), 0, torch.bfloat16))
    publisher.publish(pack(_step(_weights()), 1, torch.bfloat16))
    fresh = VersionFetcher("restarted")
    _equal(fresh.fetch(publisher.address, CRED, 1, 10), _step(_weights()))
    assert fresh.last_kinds == {"whole": 2}


def test_metadata_travels_with_the_version_and_is_checked(publisher: VersionPublisher):
    """A LoRA adapter's name and config ride in the version header (what a directory slot's
    header carries); anything but strings by name is a protocol error."""
    from weightsync.transports.net.packed import parse_metadata, plan
    from weightsync.transports.net.wire import ProtocolError

    meta = {"weightsync.adapter": "policy", "weightsync.adapter_config": '{"r": 8}'}
    packed = plan(_weights(), 0, torch.bfloat16, metadata=meta)
    packed.fill(_weights())
    publisher.publish(packed)
    got = VersionFetcher("host-b").fetch(publisher.address, CRED, None, 10)
    assert got.metadata == meta
    _equal(got, _weights())
    assert parse_metadata({}) == {}
    with pytest.raises(ProtocolError, match="metadata"):
        parse_metadata({"metadata": {"r": 8}})


def test_a_wrong_token_is_refused_both_ways(publisher: VersionPublisher):
    publisher.publish(pack(_weights(), 0))
    with pytest.raises(SenderLostError, match="wrong token|closed"):
        VersionFetcher("intruder").fetch(publisher.address, host_credential("guess", "host-b"),
                                         None, 10)
    assert publisher.figures(0) == []  # nothing streamed
    # an impostor at the trainer's address cannot prove the token either
    with socket.create_server(("127.0.0.1", 0)) as fake:
        address = f"127.0.0.1:{fake.getsockname()[1]}"

        def impostor() -> None:
            conn, _ = fake.accept()
            with conn:
                from weightsync.transports.net.handshake import accept_peer

                with pytest.raises(HandshakeError):
                    accept_peer(conn, "another-token")  # not the victim's trainer

        thread = threading.Thread(target=impostor)
        thread.start()
        with pytest.raises(SenderLostError):
            VersionFetcher("victim").fetch(address, CRED, None, 10)
        thread.join(10)


def test_a_corrupted_chunk_is_refused_and_the_base_kept(publisher: VersionPublisher):
    fetcher = VersionFetcher("host-b")
    publisher.publish(pack(_weights(), 0, torch.bfloat16))
    fetcher.fetch(publisher.address, CRED, None, 10)
    bad = pack(_step(_weights()), 1, torch.bfloat16)
    bad.checksums[1] ^= 1
    publisher.publish(bad)
    with pytest.raises(IntegrityError, match="chunk 1 of version 1"):
        fetcher.fetch(publisher.address, CRED, 1, 10)
    assert fetcher.base is not None and fetcher.base.version == 0
    assert "checksum" in (publisher.wait_streams(1, 1, 5)[0].error or "")


def test_a_trainer_gone_mid_version_is_a_named_error():
    with socket.create_server(("127.0.0.1", 0)) as fake:
        address = f"127.0.0.1:{fake.getsockname()[1]}"
    pub = VersionPublisher(address, "t", timeout=10, delta=False)
    pub.publish(pack({"x": torch.randn(CHUNK_BYTES)}, 0))
    original = pub._send_chunk

    def dies(conn, *args):  # the trainer's process ends after one chunk
        original(conn, *args)
        conn.shutdown(socket.SHUT_RDWR)
        raise ConnectionError("gone")

    pub._send_chunk = dies  # type: ignore[method-assign]
    try:
        with pytest.raises(SenderLostError, match="broke during version"):
            VersionFetcher("host-b").fetch(address, host_credential("t", "host-b"), None, 10)
    finally:
        pub.close()
    with pytest.raises(SenderLostError, match="cannot reach the trainer"):
        VersionFetcher("host-b").fetch(address, host_credential("t", "host-b"), None, 2)


def test_a_version_streams_while_the_trainer_packs_it(publisher: VersionPublisher):
    """Published before it is packed, a version streams chunk by chunk as ``fill`` releases
    them; a retired version's buffer is reused once no stream reads it."""
    import time

    from weightsync.transports.net.packed import plan

    weights = _weights()
    packed = plan(weights, 0, torch.bfloat16)
    publisher.publish(packed)
    got: dict[str, object] = {}
    fetcher = VersionFetcher("host-b")
    thread = threading.Thread(target=lambda: got.update(
        v=fetcher.fetch(publisher.address, CRED, None, 10)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # waiting for the first chunk
    packed.fill(weights)
    thread.join(10)
    _equal(got["v"], weights)
    for version in (1, 2, 3):
        nbytes = packed.nbytes
        spare = publisher.spare_buffer(nbytes)
        publisher.publish(nxt := plan(weights, version, torch.bfloat16, spare))
        nxt.fill(weights)
        fetcher.fetch(publisher.address, CRED, version, 10)
        if version == 3:  # version 0 retired when 2 was published: its buffer came back
            assert spare is not None and spare.data_ptr() == packed.buffer.data_ptr()


def test_the_trainers_digests_name_their_hash_and_match_each_chunk(publisher: VersionPublisher):
    packed = pack(_weights(), 1, torch.bfloat16)
    publisher.publish(packed)
    digests = VersionFetcher("host-b").fetch_digests(publisher.address, CRED, 1, timeout=10)
    assert digests == [chunk_digest(packed.chunk(i)) for i in range(2)]
    assert len(set(digests)) == 2 and all(len(d) == 32 for d in digests)


def test_a_host_refuses_digests_of_a_hash_it_does_not_check(
        publisher: VersionPublisher, monkeypatch: pytest.MonkeyPatch):
    """A trainer of another release (another hash) is named as such: otherwise every
    relayed chunk would be refused as forged."""
    import weightsync.transports.net.publisher as publisher_module

    monkeypatch.setattr(publisher_module, "DIGEST", "sha256-128")
    publisher.publish(pack(_weights(), 1, torch.bfloat16))
    with pytest.raises(WeightSyncError, match="hashes chunks with 'sha256-128'.*same weightsync"):
        VersionFetcher("host-b").fetch_digests(publisher.address, CRED, 1, timeout=10)
