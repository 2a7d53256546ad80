"""The scheme registry: names to classes, imported only when asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest

import weightsync as ws
from weightsync.schemes.registry import register_scheme, scheme_class, scheme_names


def test_names_select_the_schemes():
    assert scheme_class("shm") is ws.SharedMemWeightSyncScheme
    assert scheme_class("mp") is ws.MultiProcessWeightSyncScheme
    assert scheme_class("file") is ws.VLLMDoubleBufferSyncScheme
    assert {"shm", "mp", "file", "ray"} <= set(scheme_names())


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: .*shm"):
        scheme_class("carrier-pigeon")


def test_a_registered_class_is_selectable_by_name():
    register_scheme("shm-alias", ws.SharedMemWeightSyncScheme)
    assert scheme_class("shm-alias") is ws.SharedMemWeightSyncScheme


def test_a_taken_name_is_refused_and_keeps_its_class():
    with pytest.raises(ValueError, match="'shm' is already registered"):
        register_scheme("shm", ws.MultiProcessWeightSyncScheme)
    with pytest.raises(ValueError, match="already registered"):
        register_scheme("shm", ws.SharedMemWeightSyncScheme)
    assert scheme_class("shm") is ws.SharedMemWeightSyncScheme


def test_looking_up_a_name_imports_nothing_else():
    code = (
        "import sys, weightsync.schemes.registry as r; r.scheme_names(); "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
