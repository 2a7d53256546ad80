import pytest
import torch

from weightsync.core.errors import SchemaMismatchError
from weightsync.core.layout import BUCKET_ALIGNMENT, Layout


def weights():
    return {
        "a": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.randn(7, dtype=torch.float64),
        "d": torch.randn(2),
        "mask": torch.tensor([True, False, True]),
    }


def test_buckets_group_by_dtype_and_are_aligned():
    layout = Layout.from_weights(weights())
    dtypes = [b.dtype for b in layout.buckets]
    assert dtypes == [torch.float32, torch.int64, torch.float64, torch.bool]
    assert layout.buckets[0].names == ("a", "d")
    assert all(b.byte_offset % BUCKET_ALIGNMENT == 0 for b in layout.buckets)
    assert layout.names == ("a", "b", "c", "d", "mask")


def test_pack_unpack_round_trip_is_exact():
    w = weights()
    layout = Layout.from_weights(w)
    buffers = layout.allocate()
    layout.pack(w, buffers)
    out = {k: torch.zeros_like(v) for k, v in w.items()}
    layout.unpack(buffers, out)
    for k in w:
        assert torch.equal(out[k], w[k]), k


def test_pack_is_a_copy_not_a_view():
    w = weights()
    layout = Layout.from_weights(w)
    buffers = layout.allocate()
    layout.pack(w, buffers)
    w["a"].add_(100)
    assert not torch.equal(layout.tensor_views(buffers)["a"], w["a"])


def test_fingerprint_depends_on_names_shapes_dtypes_not_device():
    w = weights()
    a = Layout.from_weights(w)
    assert a.fingerprint == Layout.from_weights(dict(w)).fingerprint
    assert a.fingerprint == a.on_device("meta").fingerprint
    w2 = dict(w, a=torch.randn(4, 3))
    assert a.fingerprint != Layout.from_weights(w2).fingerprint
    w3 = dict(w, a=torch.randn(3, 4, dtype=torch.float16))
    assert a.fingerprint != Layout.from_weights(w3).fingerprint


def test_dict_round_trip_and_tamper_detection():
    layout = Layout.from_weights(weights())
    assert Layout.from_dict(layout.to_dict()) == layout
    bad = layout.to_dict()
    bad["tensors"][0]["shape"] = [4, 3]
    with pytest.raises(ValueError, match="fingerprint"):
        Layout.from_dict(bad)
    with pytest.raises(ValueError, match="dtype"):
        Layout.from_dict({"tensors": [{"name": "x", "shape": [1], "dtype": "nn"}]})


@pytest.mark.parametrize(
    ("change", "key", "fragment"),
    [
        (lambda w: w.pop("c"), "c", "missing"),
        (lambda w: w.__setitem__("a", torch.randn(4, 3)), "a", "shape (4, 3)"),
        (lambda w: w.__setitem__("b", torch.arange(5, dtype=torch.int32)), "b", "int32"),
        (lambda w: w.__setitem__("zz", torch.randn(1)), "zz", "not in"),
    ],
)
def test_check_weights_names_the_key_and_both_sides(change, key, fragment):
    w = weights()
    layout = Layout.from_weights(w)
    change(w)
    with pytest.raises(SchemaMismatchError) as info:
        layout.check_weights(w)
    assert info.value.key == key
    assert key in str(info.value) and fragment in str(info.value)


def test_check_compatible_names_the_side():
    a = Layout.from_weights(weights())
    b = Layout.from_weights(dict(weights(), d=torch.randn(3)))
    with pytest.raises(SchemaMismatchError, match="'d'.*worker 3"):
        a.check_compatible(b, other_name="worker 3")


def test_cast_on_pack():
    w = {"x": torch.randn(10), "n": torch.arange(3)}
    layout = Layout.from_weights(w).with_dtype(torch.bfloat16)
    assert layout["x"].dtype == torch.bfloat16 and layout["n"].dtype == torch.int64
    buffers = layout.allocate()
    layout.pack(w, buffers)
    assert torch.equal(layout.tensor_views(buffers)["x"], w["x"].to(torch.bfloat16))
