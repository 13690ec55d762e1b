"""The committed gRPC modules are exactly what `python -m omni._proto.build` generates."""

from pathlib import Path

import pytest

from omni._proto import build


def test_generated_modules_match_committed(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    written = build.build(tmp_path)
    assert sorted(p.name for p in written) == sorted(build.generated_names())
    for path in written:
        committed = build.PACKAGE_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m omni._proto.build` and commit the result"
        )


def test_generated_imports_are_package_relative(tmp_path: Path):
    text = (build.PACKAGE_DIR / "master_pb2_grpc.py").read_text()
    assert "from omni._proto import master_pb2" in text
    assert "from omni.v1" not in text
    from omni._proto import master_pb2, master_pb2_grpc

    assert master_pb2.DESCRIPTOR.services_by_name["Master"].methods_by_name["KeepAlive"]
    assert hasattr(master_pb2_grpc, "MasterStub")
