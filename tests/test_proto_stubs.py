"""The committed stubs match the schema (CI also runs ``python -m proto.gen --check``)."""
from proto import gen
from proto import shard_runtime_pb2 as pb


def test_committed_stubs_match_schema():
    assert gen.main(["--check"]) == 0


def test_service_exposes_the_five_calls():
    service = pb.DESCRIPTOR.services_by_name["ShardRuntime"]
    assert sorted(m.name for m in service.methods) == [
        "Cancel", "GetCapability", "Health", "Release", "Session"]
