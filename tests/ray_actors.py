"""Ray actor classes for the Ray tests (importable by Ray workers through PYTHONPATH)."""

from __future__ import annotations

import time

import ray
import torch
from workers import checksum, make_model

from weightsync.integrations.ray import RayWeightReceiverMixin


@ray.remote(num_cpus=0)
class Collector(RayWeightReceiverMixin):
    def __init__(self, scheme, idx, width=16):
        self.model = make_model(width)
        self.weightsync_setup(scheme, idx, self.model)

    def state(self):
        self.weightsync_receiver.poll()
        return self.weightsync_receiver.version, checksum(self.model)

    def scribble(self):
        with torch.no_grad():
            for t in self.model.state_dict().values():
                t.fill_(1234.0)
        return checksum(self.model)

    def receive_error(self, timeout):
        try:
            self.weightsync_receiver.receive(timeout=timeout)
        except Exception as exc:
            return type(exc).__name__
        return None

    def pid(self):
        import os

        return os.getpid()

    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def receive_outcome(self, timeout):
        """Block in receive(); return (error type or None, seconds it took, version held)."""
        t0 = time.monotonic()
        try:
            self.weightsync_receiver.receive(timeout=timeout)
        except Exception as exc:
            return type(exc).__name__, time.monotonic() - t0, self.weightsync_receiver.version
        return None, time.monotonic() - t0, self.weightsync_receiver.version

    def corrupt_wire(self, on):
        """Flip one byte of every bucket this actor receives from now on (or stop)."""
        from weightsync.transports.ray.link import ActorLink

        def flip(buffers):
            for buffer in buffers:
                flat = buffer.view(torch.uint8).reshape(-1)
                flat[flat.numel() // 2] ^= 0x10

        ActorLink.wire_hook = flip if on else None

    def damage_wire(self, kind):
        """Damage every bucket chunk this actor receives from now on as ``kind`` of
        ``slot_damage`` does (a swap or compensating pair a word sum misses); None: stop."""
        from slot_damage import NEEDS, damage_tensor

        from weightsync.transports.ray.link import ActorLink

        def damage(buffers):
            for buffer in buffers:
                if buffer.numel() * buffer.element_size() >= NEEDS:
                    damage_tensor(buffer, kind)

        ActorLink.wire_hook = damage if kind else None

    def poll_error(self):
        try:
            self.weightsync_receiver.poll()
        except Exception as exc:
            return type(exc).__name__
        return None

    def poll_timed(self):
        """(newer_published() before, what poll() returned, seconds poll() took)."""
        receiver = self.weightsync_receiver
        newer = receiver.newer_published()
        t0 = time.monotonic()
        applied = receiver.poll()
        return newer, applied, time.monotonic() - t0

    def default_group_initialised(self):
        return torch.distributed.is_initialized()

    def hammer(self, seconds, until=None):
        """Poll in a tight loop (a threaded actor receives meanwhile) for ``seconds`` (or
        until version ``until`` is held); check every tensor equals the version the
        receiver says it holds. Before its first apply (version -1) the actor holds its
        own initial weights, not version 0: a poll() may return None while a version is
        on its way (a node-local slot still being packed, or whose handle has not come),
        and the sender's connect() only delivers version 0, it applies nothing. Returns
        (reads, violations, applied, version held, reads made before the first apply)."""
        receiver = self.weightsync_receiver
        tensors = list(self.model.state_dict().values())
        initial = [t.clone() for t in tensors] if receiver.version < 0 else None
        reads = violations = applied = unversioned = 0
        self.hammering = True
        end = time.monotonic() + seconds
        while time.monotonic() < end and (until is None or receiver.version < until):
            if receiver.poll() is not None:
                applied += 1
            if receiver.version < 0:
                assert initial is not None
                unversioned += 1
                torn = any(not torch.equal(t, i) for t, i in zip(tensors, initial, strict=True))
            else:
                expected = float(receiver.version)
                torn = any(not bool((t == expected).all()) for t in tensors)
            violations += torn
            reads += 1
        return reads, violations, applied, receiver.version, unversioned

    def hammer_started(self):
        return getattr(self, "hammering", False)


@ray.remote(num_cpus=0)
class Trainer:
    """A trainer living in an actor, syncing collectors it was handed."""

    def __init__(self, scheme, collectors, width=16):
        self.model = make_model(width)
        self.sender = scheme.create_sender(collectors)
        self.sender.register_model(self.model)

    def run(self, steps):
        self.sender.connect(timeout=60)
        for _ in range(steps):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)
            self.sender.send(timeout=30)
        return self.sender.version, checksum(self.model)

    def node_id(self):
        return ray.get_runtime_context().get_node_id()


def tied_model(tied: bool) -> torch.nn.Module:
    """An embedding and an output head over one vocabulary, tied or not (as LLMs are)."""
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(64, 16),
                                 "head": torch.nn.Linear(16, 64, bias=False)})
    if tied:
        model["head"].weight = model["embed"].weight
    return model


@ray.remote(num_cpus=0)
class TiedCollector(RayWeightReceiverMixin):
    def __init__(self, scheme, idx, tied):
        self.model = tied_model(tied)
        self.weightsync_setup(scheme, idx, self.model)

    def state(self):
        self.weightsync_receiver.poll()
        embed, head = self.model["embed"].weight, self.model["head"].weight
        return (self.weightsync_receiver.version, float(embed[0, 0]), float(head[0, 0]),
                embed.data_ptr() == head.data_ptr())


def tiny_transformer(vocab: int = 8192, width: int = 256, dtype=torch.float32) -> torch.nn.Module:
    """A transformer-ish model (embedding, two encoder layers, an output head): ~5.3M
    parameters, so its bf16 version spans two of the Ray transport's 8 MB chunks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True),
            num_layers=2, enable_nested_tensor=False),
        torch.nn.Linear(width, vocab),
    )
    return model.to(dtype)


def digest(weights) -> str:
    """sha256 of every tensor's bytes, in name order: equal only if every word is."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous()
        h.update(name.encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@ray.remote(num_cpus=0)
class DeltaCollector(RayWeightReceiverMixin):
    """Holds a bf16 (or ``dtype``) tiny_transformer, as an inference actor would."""

    def __init__(self, scheme, idx, dtype=torch.bfloat16):
        torch.set_num_threads(1)
        self.model = tiny_transformer(dtype=dtype)
        with torch.no_grad():
            for t in self.model.state_dict().values():
                t.zero_()  # nothing in common with the trainer until a version arrives
        self.weightsync_setup(scheme, idx, self.model)

    def state(self):
        """(version held, digest of the model's weights) after poll()."""
        self.weightsync_receiver.poll()
        return self.weightsync_receiver.version, digest(self.model.state_dict())

    def path(self):
        return self.weightsync_receiver.path

    def announce(self):
        """Announce this actor to the sender now, as a constructor that ran late (a loaded
        machine) does after the trainer was handed its handle."""
        self.weightsync_receiver.announce()

    def damage_next_base(self, kind):
        """Damage the base chunk the next delta is rebuilt on (once), as ``kind`` of
        ``slot_damage`` does: a swap or compensating pair in this host's copy."""
        from slot_damage import damage_tensor

        from weightsync.transports.ray import delta_stream

        original = delta_stream.DeltaDecoder.decode

        def decode(decoder, chunk_kind, payload, base, out):
            delta_stream.DeltaDecoder.decode = original  # once
            damage_tensor(base, kind)
            original(decoder, chunk_kind, payload, base, out)

        delta_stream.DeltaDecoder.decode = decode

    def corrupt_next_delta(self):
        """Flip one byte of the next delta chunk this actor rebuilds (once), before it is
        verified against the sender's checksum."""
        from weightsync.transports.ray import delta_stream

        original = delta_stream.DeltaDecoder.decode

        def decode(decoder, kind, payload, base, out):
            original(decoder, kind, payload, base, out)
            out[out.numel() // 2] ^= 0x10
            delta_stream.DeltaDecoder.decode = original  # once

        delta_stream.DeltaDecoder.decode = decode

    def corrupt_next_header(self, field, value):
        """Overwrite field ``field`` (0: kind, 1: payload bytes) of chunk 0's header in the
        next stream this actor takes (once), as it arrives, before it is checked."""
        from weightsync.transports.ray.delta_stream import DeltaReceiver

        def hook(index, header):
            if index == 0:
                header[field] = value
                DeltaReceiver.header_hook = None  # once

        DeltaReceiver.header_hook = hook
