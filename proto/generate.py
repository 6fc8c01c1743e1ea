"""Regenerate the Python stubs beside the .proto files.

    python proto/generate.py          # writes proto/voxpipe/v1/*_pb2*.py
    python proto/generate.py --check  # exits 1 when the committed stubs are stale

Stubs must come from grpcio-tools 1.84.0 (the GPU image runs grpcio 1.84; newer stubs refuse
to import there). The generated modules import each other as `voxpipe.v1.*`, which the
package maps onto proto/voxpipe/v1.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REQUIRED_TOOLS = "1.84.0"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # type: ignore[import-untyped]

    protos = sorted((PROTO_ROOT / "voxpipe" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "voxpipe" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare with the committed stubs")
    args = parser.parse_args()
    import grpc_tools

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    if version != REQUIRED_TOOLS:
        print(f"warning: grpcio-tools {version}; stubs are committed from {REQUIRED_TOOLS}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for f in fresh:
            target = PROTO_ROOT / "voxpipe" / "v1" / f.name
            if args.check:
                if not target.exists() or not filecmp.cmp(f, target, shallow=False):
                    stale.append(target.name)
            else:
                target.write_bytes(f.read_bytes())
        if args.check and stale:
            print("stale generated stubs: " + ", ".join(stale) + " (run: python proto/generate.py)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
