"""``close()`` from a signal handler that interrupts the receiver's own thread mid-apply
(schemes.receiver): the handler cannot wait for the apply lock its thread holds, so the
release happens as the apply lets the lock go, and nothing deadlocks.

Each case runs in a fresh process (a deadlock there fails the test by its timeout instead
of hanging pytest), with a directory scheme whose reader applies in the same process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import os, shutil, signal, sys, tempfile
    from pathlib import Path
    import torch
    from weightsync import VLLMDoubleBufferSyncScheme

    call = sys.argv[1]
    root = Path(tempfile.mkdtemp())
    scheme = VLLMDoubleBufferSyncScheme(root / "slots", num_workers=1)
    sender = scheme.create_sender()
    sender.register_model({"w": torch.arange(1000.0)})
    sender.update_weights()

    def slot_fds():
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                found += str(root) in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return found

    senders_own = slot_fds()
    receiver = scheme.create_receiver(0)
    model = {"w": torch.zeros(1000)}
    receiver.register_model(model)

    signal.signal(signal.SIGUSR1, lambda *_: receiver.close())
    real = receiver.reader.apply_newest

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGUSR1)  # the handler runs here, the apply lock held
        return real(*args, **kwargs)

    receiver.reader.apply_newest = interrupted
    version = receiver.poll() if call == "poll" else receiver.receive(timeout=5)
    print("applied", version, bool(torch.equal(model["w"], torch.arange(1000.0))))
    print("receiver's slot fds open after close", slot_fds() - senders_own)
    try:
        receiver.poll()
    except RuntimeError as exc:
        print("then:", exc)
    sender.close()
    shutil.rmtree(root)
""")


@pytest.mark.parametrize("call", ["poll", "receive"])
def test_close_in_a_signal_handler_during_an_apply_releases_as_the_apply_ends(call):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, call], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "applied 0 True", done.stdout  # the apply under way completed
    assert lines[1] == "receiver's slot fds open after close 0", done.stdout  # and then was released
    assert "this receiver is closed" in lines[2], done.stdout
