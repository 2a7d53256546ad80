"""The relays' routes (``transports.net.relay.routes``: a chain, or a tree for many hosts
and a small version) and where a relay listens, without any host: the pool tests
(``test_net_relay.py``) run them across network namespaces."""

from __future__ import annotations

from weightsync.transports.net.relay import UPSTREAM, fan_out, local_address_toward, routes


def _relays(hosts: list[str]) -> dict[str, str]:
    return {h: f"10.0.0.{i}:7000" for i, h in enumerate(hosts)}


def test_few_hosts_form_a_chain_each_fetching_from_the_hosts_before_it_nearest_first():
    hosts = ["a", "b", "c", "d", "e"]
    relays = _relays(hosts)
    planned = routes(hosts, relays, chunks=7)
    assert planned["a"].sources == []  # the first host: the trainer
    assert planned["b"].sources == [relays["a"]]
    assert planned["e"].sources == [relays["d"], relays["c"], relays["b"]][:UPSTREAM]
    assert [planned[h].feeds for h in hosts] == [True, True, True, True, False]


def test_many_hosts_and_a_small_version_form_a_tree():
    """64 hosts, 7 chunks: a chain takes 70 chunk-times, a tree of fan-out 2 26."""
    hosts = [f"h{i}" for i in range(64)]
    relays = _relays(hosts)
    assert fan_out(64, 7) == 2
    planned = routes(hosts, relays, chunks=7)
    assert planned["h1"].sources == planned["h2"].sources == [relays["h0"]]
    assert planned["h63"].sources == [relays["h31"], relays["h15"], relays["h7"]]
    fed = [h for h in hosts if planned[h].feeds]
    assert len(fed) == 32 and planned["h31"].feeds and not planned["h32"].feeds
    # every host but the first has a parent, which feeds at most two
    parents = [planned[h].sources[0] for h in hosts[1:]]
    assert max(parents.count(r) for r in set(parents)) == 2


def test_a_large_version_stays_a_chain_however_many_hosts():
    assert fan_out(6, 7) == 1
    assert fan_out(256, 1700) == 1  # 14 GB in 8 MiB chunks
    assert fan_out(4000, 1700) > 1


def test_a_host_whose_relay_is_unknown_is_passed_over():
    planned = routes(["a", "b", "c"], {"a": "10.0.0.1:1", "c": "10.0.0.3:1"}, chunks=7)
    assert [planned[h].sources for h in "abc"] == [[], ["10.0.0.1:1"], ["10.0.0.1:1"]]


def test_a_relay_listens_on_the_address_that_reaches_the_trainer():
    assert local_address_toward("127.0.0.1:29600") == "127.0.0.1"
