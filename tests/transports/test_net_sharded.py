"""A sharded trainer on the network transport, without vLLM: two trainer ranks (rank 0
here, rank 1 a spawned process) each serve their own ``ws.LocalShard`` rows from their own
listener; a receiving host fetches every rank's part, checks each chunk, puts the global
tensors together and stages them in a real directory, where a worker reads them. No rank
gathers anything. A missing rank is ``TrainerRankLostError`` naming it, within the deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import time
from pathlib import Path

import pytest
import rank_harness as net_ranks
import torch
from rank_harness import free_port
from stopped import stop_process

import weightsync as ws
from weightsync.core.deadline import Deadline
from weightsync.schemes.double_buffer import VLLMDoubleBufferSyncScheme
from weightsync.serving.host_receiver import HostReceiver, request_key
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.sharded import NetRankLead, NetRankMember, board_address, host_token

pytest.importorskip("zstandard")

TIMEOUT = 20.0


def _read_staged(directory: Path, local: int) -> dict[str, torch.Tensor]:
    """What a worker loads of the staged version ``local``."""
    model = {"bias": torch.zeros(5, dtype=torch.bfloat16),
             "matrix": torch.zeros(net_ranks.NET_ROWS, net_ranks.NET_COLS, dtype=torch.bfloat16)}
    receiver = VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=10).create_receiver(0)
    receiver.register_model(model)
    receiver.connect(timeout=10)
    try:
        receiver.apply_version(local, timeout=10)
    finally:
        receiver.close()
    return model


@pytest.mark.parametrize("board", ["host", "tcp"])
def test_two_ranks_stream_their_own_rows_to_a_host(tmp_path: Path, board: str):
    """``board``: the ranks meet on the trainer's host, or over TCP (ranks on several hosts)."""
    key = secrets.token_hex(32)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    versions = 3
    at = f"127.0.0.1:{free_port()}" if board == "tcp" else ""
    child = ctx.Process(target=net_ranks.member_main,
                        args=(key, versions, TIMEOUT, results, 0, at), daemon=True)
    child.start()
    lead = NetRankLead("127.0.0.1:0", key, 2, dtype=torch.bfloat16, timeout=TIMEOUT, delta=True,
                       board=at)
    host = HostReceiver(tmp_path / "staged", 1, "host-b", TIMEOUT)
    staged: dict[int, int] = {}
    kinds: list[dict[str, int]] = []

    def deliver(version: int, addresses: list[str]) -> None:
        assert len(set(addresses)) == 2  # one listener per rank: each rank's bytes go direct
        staged[version] = host.stage(addresses, host_credential(host_token(key), "host-a"), version,
                                     request_key("t", str(version)), TIMEOUT)
        kinds.append(host.sharded.last_kinds)

    try:
        for version in range(versions):
            lead.send(net_ranks.rank_flat(0, version), version, Deadline(TIMEOUT), deliver)
            got = _read_staged(tmp_path / "staged", staged[version])
            for name, want in net_ranks.full_weights(version).items():
                assert torch.equal(got[name], want.to(torch.bfloat16)), (version, name)
        assert [results.get(timeout=TIMEOUT) for _ in range(versions)] == \
            [("sent", v) for v in range(versions)]
        assert "whole" in kinds[0] and not any(k != "whole" for k in kinds[0])
        assert sum(n for k, n in kinds[-1].items() if k != "whole") >= 2  # each rank: a delta
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        lead.close()
        host.close()
        if child.is_alive():
            child.kill()


def test_a_rank_that_never_appears_is_named_on_rank_0():
    lead = NetRankLead("127.0.0.1:0", secrets.token_hex(32), 2, dtype=None, timeout=3,
                       delta=False)
    started = time.monotonic()
    try:
        with pytest.raises(ws.TrainerRankLostError) as info:
            lead.send(net_ranks.rank_flat(0, 0), 0, Deadline(3.0),
                      lambda v, a: pytest.fail("delivered without rank 1"))
    finally:
        lead.close()
    assert info.value.rank == 1 and "did not join version 0" in str(info.value)
    assert time.monotonic() - started < 3.5


def test_rank_0_that_never_appears_is_named_on_rank_1():
    member = NetRankMember("127.0.0.1:0", secrets.token_hex(32), 1, dtype=None, timeout=2,
                           delta=False)
    try:
        with pytest.raises(ws.TrainerRankLostError) as info:
            member.open(Deadline(2.0))
    finally:
        member.close()
    assert info.value.rank == 0


def test_a_lost_rank_fails_the_version_and_the_next_takes_its_number(tmp_path: Path):
    """Rank 1 sends once and exits: rank 0's second version fails naming it; a new rank 1
    joins and the version that commits next has the failed one's number."""
    key = secrets.token_hex(32)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    lead = NetRankLead("127.0.0.1:0", key, 2, dtype=torch.bfloat16, timeout=TIMEOUT, delta=True)
    host = HostReceiver(tmp_path / "staged", 1, "host-b", TIMEOUT)

    staged: dict[int, int] = {}

    def deliver(version: int, addresses: list[str]) -> None:
        staged[version] = host.stage(addresses, host_credential(host_token(key), "host-a"), version,
                                     request_key("t", str(version)), TIMEOUT)

    second = None
    first = ctx.Process(target=net_ranks.member_main, args=(key, 1, TIMEOUT, results), daemon=True)
    first.start()
    try:
        lead.send(net_ranks.rank_flat(0, 0), 0, Deadline(TIMEOUT), deliver)
        assert results.get(timeout=TIMEOUT) == ("sent", 0)
        first.join(TIMEOUT)
        with pytest.raises(ws.TrainerRankLostError) as info:
            lead.send(net_ranks.rank_flat(0, 1), 1, Deadline(3.0), deliver)
        assert info.value.rank == 1
        second = ctx.Process(target=net_ranks.member_main,
                             args=(key, 1, TIMEOUT, results, 1), daemon=True)
        second.start()
        lead.send(net_ranks.rank_flat(0, 1), 1, Deadline(TIMEOUT), deliver)
        assert results.get(timeout=TIMEOUT) == ("sent", 1)
        got = _read_staged(tmp_path / "staged", staged[1])
        for name, want in net_ranks.full_weights(1).items():
            assert torch.equal(got[name], want.to(torch.bfloat16)), name
        second.join(TIMEOUT)
    finally:
        lead.close()
        host.close()
        for child in (first, second):
            if child is not None and child.is_alive():
                child.kill()


def test_a_server_that_fails_does_not_fail_the_ranks_version(tmp_path: Path):
    """Every rank wrote version 0 and the hosts' delivery fails at a server alone: the
    version is committed on every rank (rank 1's send returns it) and rank 0 raises the
    server's error; the next version is 1 (a failed round's number would be taken again,
    as on every medium, but this round did not fail)."""
    key = secrets.token_hex(32)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=net_ranks.member_main, args=(key, 2, TIMEOUT, results),
                        daemon=True)
    child.start()
    lead = NetRankLead("127.0.0.1:0", key, 2, dtype=torch.bfloat16, timeout=TIMEOUT, delta=True)

    def server_fails(version: int, addresses: list[str]) -> None:
        raise ws.WeightSyncError(f"version {version} is not served by 1 of 1 servers")

    try:
        with pytest.raises(ws.WeightSyncError, match="not served by 1 of 1"):
            lead.send(net_ranks.rank_flat(0, 0), 0, Deadline(TIMEOUT), server_fails)
        assert lead.committed == 0
        assert results.get(timeout=TIMEOUT) == ("sent", 0)
        lead.send(net_ranks.rank_flat(0, 1), 1, Deadline(TIMEOUT), lambda v, a: None)
        assert results.get(timeout=TIMEOUT) == ("sent", 1)
        child.join(TIMEOUT)
    finally:
        lead.close()
        if child.is_alive():
            child.kill()


@pytest.mark.parametrize("board", ["host", "tcp"])
def test_a_server_holding_the_host_token_cannot_join_the_ranks(board: str):
    """What a server host holds (the host token, in its ``init_info``) does not pass rank 0's
    rank handshake, on the host's board or over TCP: the rank key stays with the ranks."""
    from weightsync.transports.net.board import connect_tcp
    from weightsync.transports.ranks.socket_board import RankLink

    key = secrets.token_hex(32)
    at = f"127.0.0.1:{free_port()}" if board == "tcp" else ""
    lead = NetRankLead("127.0.0.1:0", key, 2, dtype=None, timeout=5, delta=False, board=at)
    if at:
        link = RankLink(at, host_token(key), None, 1,
                        connect=lambda timeout: connect_tcp(at, timeout))
    else:
        link = RankLink(board_address(key), host_token(key), os.getuid(), 1)
    try:
        with pytest.raises(ws.TrainerRankLostError, match="could not join rank 0"):
            link.open(Deadline(5.0))
        with pytest.raises(ws.TrainerRankLostError) as info:
            lead.send(net_ranks.rank_flat(0, 0), 0, Deadline(1.5),
                      lambda v, a: pytest.fail("delivered without rank 1"))
        assert info.value.rank == 1
    finally:
        link.close()
        lead.close()


def _fetch_fails_while_rank_1(tmp_path: Path, what: str) -> ws.TrainerRankLostError:
    """Rank 1 writes its part of version 0; then, as the host starts to fetch, it is killed
    (``what="dies"``) or suspended (``"stalls"``). Returns what rank 0's send raised."""
    key = secrets.token_hex(32)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()  # held here until the end: the child reports into it
    child = ctx.Process(target=net_ranks.member_main, args=(key, 1, TIMEOUT, results),
                        daemon=True)
    child.start()
    lead = NetRankLead("127.0.0.1:0", key, 2, dtype=torch.bfloat16, timeout=TIMEOUT, delta=True)
    host = HostReceiver(tmp_path / "staged", 1, "host-b", TIMEOUT)

    def deliver(version: int, addresses: list[str]) -> None:
        assert child.pid is not None
        if what == "dies":
            child.kill()
            child.join(TIMEOUT)
            time.sleep(0.5)  # rank 0's board sees the connection end
        else:
            stop_process(child.pid)
        host.stage(addresses, host_credential(host_token(key), "host-a"), version, request_key("t", "0"), 5.0)

    started = time.monotonic()
    try:
        with pytest.raises(ws.TrainerRankLostError) as info:
            lead.send(net_ranks.rank_flat(0, 0), 0, Deadline(TIMEOUT), deliver)
        assert time.monotonic() - started < TIMEOUT
        return info.value
    finally:
        lead.close()
        host.close()
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
            child.kill()


def test_a_rank_that_dies_while_the_hosts_fetch_is_named(tmp_path: Path):
    """Rank 1 wrote its part and dies before the host fetched it: the host's fetch fails,
    and rank 0's send raises ``TrainerRankLostError`` naming rank 1 (not only the host)."""
    error = _fetch_fails_while_rank_1(tmp_path, "dies")
    assert error.rank == 1 and "while the hosts fetched version 0" in str(error)
    assert "cannot reach the trainer" in str(error)


def test_a_rank_that_stalls_while_the_hosts_fetch_is_named(tmp_path: Path):
    """Rank 1 wrote its part and is suspended (SIGSTOP) before the host fetched it: the
    host's fetch times out, and rank 0's send raises ``TrainerRankLostError`` naming rank 1
    as stalled (it stopped answering rank 0's pings), not only the host's error."""
    error = _fetch_fails_while_rank_1(tmp_path, "stalls")
    assert error.rank == 1 and "stopped answering" in str(error), error
    assert "while the hosts fetched version 0" in str(error)
