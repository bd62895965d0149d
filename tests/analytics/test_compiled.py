"""The decoder runs compiled (mypyc) where scripts/setup.sh installed it, and compiled reads as protobuf reads.

A broken build must not fall back to the (slower) source silently: the installed tree
is held to its compiled module here.  The source runs instead of a build older than
itself, and without any build; the wire reader the compiled decoder uses for common
SingleMessageMetadata gives what protobuf gives, or leaves the message to protobuf.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

import proxy.analytics
from proxy.analytics import compiled, decode
from proxy.errors import BatchError
from proxy.pb import PulsarApi_pb2 as api


def test_the_installed_tree_runs_every_listed_module_compiled() -> None:
    """scripts/setup.sh built each module and it is current; were it not, this names what to run."""
    for name in proxy.analytics.COMPILED_MODULES:
        module = importlib.import_module(f"proxy.analytics.{name}")
        assert compiled.STATES[module.__name__] == compiled.COMPILED, compiled.STATES
        assert compiled.is_compiled(module), module.__file__
    assert decode._READ_WIRE


def _package(tmp_path: Path, name: str, *, extension: bool, stamp: str | None) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "__init__.py").write_text(
        "from pathlib import Path\nfrom proxy.analytics import compiled\n"
        "compiled.guard(__name__, Path(__file__).parent, ['kernel'])\n")
    (directory / "kernel.py").write_text("WHERE = 'source'\n")
    if extension:  # not loadable: importing it instead of the source would fail the test
        (directory / f"kernel{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not an extension")
    if stamp is not None:
        (directory / compiled.STAMP_NAME).write_text(stamp)
    return directory


def test_a_build_older_than_its_source_is_passed_over_and_a_missing_build_is_no_error(tmp_path: Path) -> None:
    sys.path.insert(0, str(tmp_path))
    try:
        _package(tmp_path, "stale_build", extension=True, stamp="0" * 64 + "  kernel.py\n")
        _package(tmp_path, "no_build", extension=False, stamp=None)
        _package(tmp_path, "unstamped_build", extension=True, stamp=None)
        for package, state in (("stale_build", compiled.STALE), ("no_build", compiled.NOT_BUILT),
                               ("unstamped_build", compiled.STALE)):
            kernel = importlib.import_module(f"{package}.kernel")
            assert kernel.WHERE == "source"
            assert compiled.STATES[f"{package}.kernel"] == state
            assert not compiled.is_compiled(kernel)
    finally:
        sys.path.remove(str(tmp_path))
        for package in ("stale_build", "no_build", "unstamped_build"):
            sys.modules.pop(f"{package}.kernel", None)
            sys.modules.pop(package, None)


def _protobuf_values(meta: bytes) -> tuple[Any, ...] | str:
    try:
        return decode._single_message_values(meta, 3, 1000)
    except BatchError as exc:
        return str(exc)


_TEXT = st.text(max_size=4)
_NUMBER = st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1))


@st.composite
def single_metadata(draw: st.DrawFn) -> bytes:
    """SingleMessageMetadata with any of its fields (some required ones missing), maybe damaged."""
    meta = api.SingleMessageMetadata()
    for name, values in (("payload_size", st.integers(-2**31, 2**31 - 1)), ("partition_key", _TEXT),
                         ("compacted_out", st.booleans()), ("event_time", _NUMBER),
                         ("partition_key_b64_encoded", st.booleans()), ("ordering_key", st.binary(max_size=3)),
                         ("sequence_id", _NUMBER), ("null_value", st.booleans()),
                         ("null_partition_key", st.booleans())):
        if draw(st.integers(0, 2)):
            setattr(meta, name, draw(values))
    for _ in range(draw(st.integers(0, 2) if draw(st.integers(0, 5)) == 0 else st.just(0))):
        meta.properties.add(key=draw(_TEXT), value=draw(_TEXT))
    data = meta.SerializePartialToString()
    if draw(st.booleans()):  # a field again (the last one wins), or a field protobuf does not know
        data += draw(st.sampled_from([b"\x18\x05", b"\x40\x00", b"\x12\x01z", b"\x58\x01", b"\x1a\x00", b"\x45"]))
    damage = draw(st.integers(0, 3))
    if damage == 1 and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
    elif damage == 2:
        data = data[:draw(st.integers(0, len(data)))]
    return data


@given(st.one_of(single_metadata(), st.binary(max_size=24)))
@settings(max_examples=2000, deadline=None)
@example(b"\x18\x03")
@example(b"\x18\x03\x12\x02\xff\xfe")  # a key that is not UTF-8
@example(b"\x18\xff\xff\xff\xff\x0f")  # payload_size -1 as an over-long varint
@example(b"\x18\x03\x40\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01")  # sequence id past 63 bits
def test_the_wire_reader_gives_what_protobuf_gives_or_leaves_the_message_to_it(meta: bytes) -> None:
    fields = decode.single_message_fields(b"\x00\x00" + meta + b"\x99", 2, 2 + len(meta))
    if fields[0]:
        assert decode.common_message_values(fields, 3, 1000) == _protobuf_values(meta)


def test_the_wire_reader_reads_what_clients_send() -> None:
    """Not leaving everything to protobuf: batches as the Java and C++ clients write them are read off the wire."""
    for meta in (api.SingleMessageMetadata(payload_size=120),
                 api.SingleMessageMetadata(payload_size=0, partition_key="", sequence_id=0),
                 api.SingleMessageMetadata(payload_size=9, partition_key="k\u00e9", sequence_id=2**63 - 1,
                                           event_time=17, ordering_key=b"o", null_value=True)):
        data = meta.SerializeToString()
        fields = decode.single_message_fields(data, 0, len(data))
        assert fields[0], meta
        assert decode.common_message_values(fields, 3, 1000) == _protobuf_values(data)
