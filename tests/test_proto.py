"""The committed gRPC stubs are what `python proto/generate.py` makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_are_fresh():
    proc = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_stubs_name_the_three_stage_services_and_the_gateway():
    from voxpipe.v1 import gateway_pb2, stages_pb2

    services = set(stages_pb2.DESCRIPTOR.services_by_name) | set(gateway_pb2.DESCRIPTOR.services_by_name)
    assert {"Thinker", "Talker", "Code2Wav", "Gateway"} <= services


def test_token_ids_travel_packed_from_the_threshold_on_and_come_back_the_same():
    import pytest

    from voxpipe.services.runtime.tensors import PACKED_IDS_MIN, ids_of, ids_proto
    from voxpipe.v1 import stages_pb2 as pb
    short, long = list(range(PACKED_IDS_MIN - 1)), [2**32 - 1, 0] + list(range(PACKED_IDS_MIN))
    assert ids_proto(short).packed == b"" and list(ids_proto(short).ids) == short
    msg = pb.TokenIds.FromString(ids_proto(long).SerializeToString())
    assert len(msg.ids) == 0 and len(msg.packed) == 4 * len(long) and ids_of(msg) == long
    out = pb.TokenIds(ids=[5, 6])
    assert ids_proto(long, out) is out and len(out.ids) == 0 and ids_of(out) == long   # the old form cleared
    for bad in ([-1] + long, [2**32] + long, [2**70] + long, [1.5] + long, ["7"] + long):
        with pytest.raises(ValueError, match=r"integers in \[0, 2\^32\)"):
            ids_proto(bad)
    with pytest.raises(ValueError, match="commit: set ids or packed, not both"):
        ids_of(pb.TokenIds(ids=[1], packed=bytes(4)), "commit")
    with pytest.raises(ValueError, match="token_ids.packed: 7 bytes"):
        ids_of(pb.TokenIds(packed=bytes(7)))
