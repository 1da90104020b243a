"""Reading collectives from compiled HLO text: every form XLA writes device groups
in (lists, iota tile assignments, its own reshaped mesh with sub-axes), how many
times a loop runs each, the asynchronous forms, and the computations that never
run; and device groups mapped back to the user's mesh axes.

What XLA on CPU emits today is covered end to end in test_collectives.py; this
file holds the forms it may emit elsewhere (other releases, GPU, TPU).
"""

import itertools

import numpy as np
import pytest

from jaxtyping_shard._core import compat
from jaxtyping_shard._report import collectives as _collectives, groups as _groups, hlo
from jaxtyping_shard._report.sources import Frame, Sources

from .helpers import MESHES


@pytest.mark.parametrize(
    "text, groups",
    [
        ("replica_groups={{0,1},{2,3}}, x=1", ((0, 1), (2, 3))),
        ("replica_groups={}, to_apply=%add", ()),
        ("replica_groups=[2,4]<=[8], dimensions={0}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups=[4,2]<=[4,2]T(1,0)", ((0, 2), (4, 6), (1, 3), (5, 7))),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
        # XLA's own mesh: the devices in order, grouped over the named axes.
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, use_global_device_ids",
         ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("replica_groups=mesh['a'=4,'b'=1,'c'=2] {'c'}",
         ((0, 1), (2, 3), (4, 5), (6, 7))),
        ("replica_groups=mesh['a'=2,'b'=4] {'a','b'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        # ... with its devices reordered: [4,2]T(1,0) lists 0,2,4,6,1,3,5,7.
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}",
         ((0, 2, 4, 6), (1, 3, 5, 7))),
        ("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}",
         ((0, 1), (2, 3), (4, 5), (6, 7))),
        # ... and sub-axes `'a':(pre)size`: index bits of one axis.
        ("replica_groups=mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}",
         ((0, 1, 4, 5), (2, 3, 6, 7))),
        # a=4 split in two bits: the major one (pre 1) grouped with `b`.
        ("replica_groups=mesh['a'=4,'b'=2] {'a':(1)2,'b'}",
         ((0, 1, 4, 5), (2, 3, 6, 7))),
        ("channel_id=1, dimensions={0}", None),  # absent
        ("replica_groups=mesh['a'=8] {'a':(3)2}", None),  # unreadable: not guessed
    ],
)  # fmt: skip
def test_device_group_forms(text, groups):
    found = _groups.groups(text)
    if groups is None:
        assert found is None
    else:
        assert found is not None
        assert sorted(map(sorted, found)) == sorted(map(sorted, groups))


def test_mesh_groups_match_a_brute_force_reading():
    # Differential: every axis subset of a 2x2x2 mesh, with and without its
    # devices reordered, against the groups computed from coordinates.
    names = ("x", "y", "z")
    for order in ("", ", device_ids=([2,4]T(1,0))", ", device_ids=([8])"):
        ids = np.arange(8) if order != ", device_ids=([2,4]T(1,0))" else (
            np.arange(8).reshape(2, 4).T.reshape(-1))  # fmt: skip
        grid = ids.reshape(2, 2, 2)
        for k in (1, 2, 3):
            for axes in itertools.combinations(range(3), k):
                text = "mesh['x'=2,'y'=2,'z'=2]{} {{{}}}".format(
                    order, ",".join(f"'{names[a]}'" for a in axes)
                )
                found = _groups.groups("replica_groups=" + text)
                assert found is not None, text
                kept = [a for a in range(3) if a not in axes]
                want = grid.transpose(kept + list(axes)).reshape(-1, 2**k)
                assert sorted(map(sorted, found)) == sorted(
                    map(sorted, want.tolist())
                ), text


MODULE = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

%inner (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %nested = f32[4]{0} all-reduce(%p), channel_id=3, replica_groups={{0,1}}, to_apply=%add
}

%body (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %looped = f32[4]{0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %w3 = f32[4]{0} while(%looped), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
}

%cond (p: f32[4]) -> pred[] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = pred[] constant(true)
}

%loose (p: bf16[2,3]) -> bf16[2,3] {
  %p = bf16[2,3]{1,0} parameter(0)
  ROOT %unknown = bf16[2,3]{1,0} all-to-all(%p), channel_id=4, replica_groups={{0,1}}, dimensions={0}
}

%branch (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %in_branch = f32[4]{0} collective-permute(%p), channel_id=5, source_target_pairs={{0,1},{1,0}}
}

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %never = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add
}

%dead (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %unused = f32[4]{0} all-reduce(%p), replica_groups={}, to_apply=%add
}

ENTRY %main (x: f32[4], y: bf16[2,3], i: s32[]) -> f32[8] {
  %x = f32[4]{0} parameter(0), sharding={replicated}
  %y = bf16[2,3]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %w = f32[4]{0} while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %w2 = bf16[2,3]{1,0} while(%y), condition=%cond, body=%loose
  %k = f32[4]{0} conditional(%i, %x, %x), branch_computations={%branch, %inner}
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
  %start = (f32[4]{0}, f32[8]{0}) all-gather-start(%w), channel_id=6, replica_groups={{0,1}}, dimensions={0}
  %done = f32[8]{0} all-gather-done(%start)
  %two = (f32[4]{0}, bf16[2,3]{1,0}) all-reduce(%k, %w2), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %out = f32[8]{0} copy(%done)
}
"""  # noqa: E501


def test_module_reading_loops_branches_async_and_dead_code():
    found, graph = hlo.read(MODULE)
    by_name = {c.name: c for c in found}
    assert set(by_name) == {"looped", "nested", "unknown", "in_branch", "start", "two"}
    assert by_name["looped"].executions == 5
    assert by_name["nested"].executions == 5 * 3 + 1  # in the loop, and a branch
    assert by_name["unknown"].unknown_trips and by_name["unknown"].executions == 1
    assert by_name["in_branch"].executions == 1
    # A call runs one branch of the conditional `k`: each collective in one says
    # which; `inner`, reached from a loop too, is not inside it on every path.
    assert by_name["in_branch"].branches == (hlo.Branch("k", 0, 2),)
    assert by_name["nested"].branches == ()
    assert not any(by_name[n].branches for n in ("looped", "unknown", "two"))
    assert by_name["in_branch"].pairs == ((0, 1), (1, 0))
    start = by_name["start"]
    assert start.kind == "all-gather" and start.groups == ((0, 1),)
    assert [(o.name, o.dtype, o.dims, o.bytes) for o in start.operands] == [
        ("w", "f32", (4,), 16)
    ]
    two = by_name["two"]
    assert [(o.name, o.bytes) for o in two.operands] == [("k", 16), ("w2", 12)]
    assert graph.operands["two"] == ("k", "w2")
    assert graph.users["done"] == ("out",)


def test_dtypes_and_sizes():
    assert hlo.arrays("(f32[2,16]{1,0}, bf16[3]{0}, s32[], token[])") == [
        ("f32", (2, 16)), ("bf16", (3,)), ("s32", ())
    ]  # fmt: skip
    assert hlo.arrays("f32[<=8,4]{1,0}") == [("f32", (8, 4))]  # a dynamic bound
    assert hlo.nbytes("f32", (2, 16)) == 128
    assert hlo.nbytes("pred", (3,)) == 3
    assert hlo.nbytes("s4", (3,)) == 2
    assert hlo.nbytes("f8e4m3fn", (5,)) == 5
    # Sub-byte types packed, as XLA stores them (issue 33, item 5).
    assert hlo.nbytes("f4e2m1fn", (5,)) == 3
    assert hlo.nbytes("u2", (5,)) == 2
    assert hlo.nbytes("c128", (2,)) == 32 and hlo.nbytes("bf16", (3,)) == 6
    assert [hlo.jax_dtype(d) for d in ("f32", "bf16", "s8", "u4", "pred", "c64")] == [
        "float32", "bfloat16", "int8", "uint4", "bool", "complex64"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kind, groups, pairs, axes, over, size",
    [
        ("all-reduce", ((0, 2, 4, 6), (1, 3, 5, 7)), (), ("data",), "data", 4),
        ("all-gather", ((0, 1), (2, 3), (4, 5), (6, 7)), (), ("model",), "model", 2),
        ("all-reduce", (tuple(range(8)),), (), ("data", "model"), "data+model", 8),
        ("all-reduce", (), (), ("data", "model"), "data+model", 8),  # one group: all
        # Groups that span part of an axis say how much of it.
        ("all-reduce", ((0, 2), (4, 6), (1, 3), (5, 7)), (), ("data",),
         "data (2 of 4)", 2),
        ("collective-permute", None, ((0, 2), (2, 4), (4, 6), (6, 0)), ("data",),
         "data", 4),
        ("collective-permute", None, ((0, 0), (1, 1)), (), "", 2),  # moves nothing
        ("all-gather", None, (), (), "?", 8),  # groups unread: said, bytes bounded
    ],
)  # fmt: skip
def test_groups_to_axes(kind, groups, pairs, axes, over, size):
    mesh = MESHES["explicit"]()  # data=4, model=2: partition p at (p // 2, p % 2)
    coords = _groups.coordinates(mesh)
    got = _groups.axes(kind, groups, pairs, coords, mesh, 8)
    assert got == (axes, over, size)


def test_bytes_each_device_receives():
    # An operand of 100 bytes on each device, 4 devices per group.
    assert _collectives._moved("all-gather", 100, 4) == 300
    assert _collectives._moved("all-reduce", 100, 4) == 150
    assert _collectives._moved("reduce-scatter", 100, 4) == 75
    assert _collectives._moved("all-to-all", 100, 4) == 75
    assert _collectives._moved("collective-permute", 100, 4) == 100
    assert _collectives._moved("all-reduce", 100, 1) == 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _message(*fields) -> bytes:
    """Protobuf wire format: `(number, int)` varints, `(number, bytes)` strings."""
    out = b""
    for number, value in fields:
        if isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            data = value.encode() if isinstance(value, str) else value
            out += _varint(number << 3 | 2) + _varint(len(data)) + data
    return out


def test_stack_frames_read_from_the_serialized_module():
    # An HloModuleProto by hand (field numbers of xla/service/hlo.proto): three
    # instructions, with a frame id, with a frame id pointing out of the tables,
    # and with only the inline frame JAX 0.8 writes.
    instructions = [
        _message((1, "a"), (7, _message((2, "jit(f)/mul"), (15, 2)))),
        _message((1, "b"), (7, _message((15, 3)))),
        _message((1, "c"), (7, _message((3, "/x/g.py"), (4, 7)))),
        _message((1, "d")),
    ]
    computation = _message((1, "main"), *[(2, i) for i in instructions])
    index = _message(
        (1, "/x/f.py"),
        (2, "outer"),
        (2, "inner"),
        (3, _message((1, 1), (2, 1), (3, 10))),
        (3, _message((1, 1), (2, 2), (3, 20))),
        (4, _message((1, 1))),
        (4, _message((1, 2), (2, 1))),
        (4, _message((1, 5), (2, 1))),  # location 5: not in the table
    )
    proto = _message((1, "m"), (3, computation), (17, index))
    sources = Sources(proto)
    if compat.hlo_stack_frames_usable():
        assert sources.stack("a") == (
            Frame("/x/f.py", "inner", 20),
            Frame("/x/f.py", "outer", 10),
        )
    else:  # JAX 0.8: its ids are not read, only the inline frame
        assert sources.stack("a") == ()
    assert sources.stack("b") == ()
    assert sources.stack("c") == (Frame("/x/g.py", "", 7),)
    assert sources.stack("d") == sources.stack("nothing") == ()
    # Only the computations asked for are read.
    assert Sources(proto, frozenset({"other"})).stack("c") == ()
