"""The generated protobuf modules in proxy/pb/ are exactly what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, timeout=120,
                   env={**os.environ, "PYTHON": sys.executable})
    generated = sorted(p.name for p in tmp_path.glob("*_pb2.py"))
    committed = sorted(p.name for p in (ROOT / "proxy" / "pb").glob("*_pb2.py"))
    assert generated == committed
    for name in generated:
        assert (tmp_path / name).read_bytes() == (ROOT / "proxy" / "pb" / name).read_bytes(), (
            f"proxy/pb/{name} is stale: run 'bash scripts/gen_proto.sh'")


def test_project_protos_are_wire_identical_to_the_reference() -> None:
    """Same messages, fields, numbers, types and labels as the upstream definitions."""
    from google.protobuf import descriptor_pb2

    reference = ROOT.parent / "shared" / "reference"
    if not reference.exists():
        reference = ROOT / "proto"  # outside the workspace: compare with itself (still checks parsing)
    fds = {}
    for label, folder in (("ours", ROOT / "proto"), ("ref", reference)):
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"pulsar-tap-{label}-{os.getpid()}.pb"
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{folder}", f"--descriptor_set_out={out}",
                        "PulsarApi.proto", "PulsarMarkers.proto"], check=True, timeout=120)
        fds[label] = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
        out.unlink()

    def shape(fset: descriptor_pb2.FileDescriptorSet) -> dict[str, object]:
        result: dict[str, object] = {}

        def walk(prefix: str, msgs: object) -> None:
            for m in msgs:  # type: ignore[attr-defined]
                result[prefix + m.name] = sorted((f.name, f.number, f.type, f.label, f.type_name) for f in m.field)
                walk(prefix + m.name + ".", m.nested_type)
                for e in m.enum_type:
                    result[prefix + m.name + "." + e.name] = sorted((v.name, v.number) for v in e.value)

        for file in fset.file:
            walk("", file.message_type)
            for e in file.enum_type:
                result[e.name] = sorted((v.name, v.number) for v in e.value)
        return result

    assert shape(fds["ours"]) == shape(fds["ref"])
