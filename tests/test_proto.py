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
