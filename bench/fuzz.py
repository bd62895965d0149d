"""Coverage-guided fuzzing of everything that reads what a peer sends: the scanner, the codec, the relay.

Three targets, chosen by an input's first byte (see :func:`run_one`):

- ``frames``: the relay's FrameScanner (with the input's choice of wanted types) and
  FrameDecoder, fed the same bytes cut into the same pieces, reach the same verdict —
  the same error, word for word, or the same frames; the scanner lets through a
  prefix of the input and never a byte of the frame that fails.
- ``codec``: whatever FrameDecoder accepts decodes with nothing but ProtocolErrors:
  the command, the payload section, metadata, messages (decompression, batches,
  markers); the same bytes read leniently, as from a recording, render as ``show``
  and ``show --json`` render them, and redact.
- ``pipeline``: the sans-IO relay of one connection (rules that look at every command
  type, observers on) fed a CONNECT and then the input from the client and the broker
  side: nothing but ProtocolErrors, and nothing more once one was raised.

Every target must also finish: an input that runs for more than ``--hang-seconds``
is a hang.  The corpus is the official client's frames (``tests/golden/vectors.json``)
and one frame of every command type; before fuzzing, the *split-frame family* is
swept deterministically: every corpus frame, alone and followed by one more byte,
cut at every offset of its head and end and in three at every pair of offsets of
its first 14 bytes — the family of the one-frame hang of issue #12.

    .venv/bin/python bench/fuzz.py --runs 1000000        # the long mode
    .venv/bin/python bench/fuzz.py --seconds 30          # the CI mode (tests/test_fuzz.py runs it)

The fuzzing itself is atheris (libFuzzer) in a child process; the report gives the
inputs run, crashes, hangs and seconds, and exits 1 on any crash or hang (the input
is kept under ``--artifacts``, default ``./fuzz-artifacts``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import itertools
import json
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.errors import ProtocolError  # noqa: E402
from proxy.pb import PulsarApi_pb2 as api  # noqa: E402
from proxy.protocol.commands import SUB_FIELDS, TYPE_NAMES, wrap  # noqa: E402
from proxy.protocol.frame import (  # noqa: E402
    Frame,
    FrameDecoder,
    encode_command,
    encode_payload_command,
)

TARGETS = ("frames", "codec", "pipeline")
MAX_CUTS = 7
LIMIT = 64 * 1024  # a small frame limit, so that limits are hit too
VECTORS = ROOT / "tests" / "golden" / "vectors.json"


# -- inputs ----------------------------------------------------------------------------------
def encode_input(target: int, flags: int, cuts: list[int], data: bytes) -> bytes:
    """An input in the fuzzer's format: target, flags, cut count, cuts (u16 each), then the bytes."""
    cuts = cuts[:MAX_CUTS]
    return bytes([target, flags, len(cuts)]) + b"".join(struct.pack(">H", c & 0xFFFF) for c in cuts) + data


def decode_input(raw: bytes) -> tuple[int, int, list[int], bytes]:
    if len(raw) < 3:
        return 0, 0, [], raw
    target, flags, count = raw[0] % len(TARGETS), raw[1], raw[2] % (MAX_CUTS + 1)
    head = 3 + 2 * count
    cuts = [struct.unpack_from(">H", raw, 3 + 2 * i)[0] for i in range(count) if 3 + 2 * i + 2 <= len(raw)]
    return target, flags, cuts, raw[head:]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


# -- the corpus ------------------------------------------------------------------------------
def one_of_every_type() -> list[bytes]:
    """A frame of every command type, its required fields set (payload types with a payload)."""
    frames = []
    for number, field in SUB_FIELDS.items():
        sub = getattr(api.BaseCommand(), field).__class__()
        _fill_required(sub)
        cmd = wrap(sub)
        if number in (api.BaseCommand.SEND, api.BaseCommand.MESSAGE):
            frames.append(encode_payload_command(cmd, api.MessageMetadata(
                producer_name="p", sequence_id=1, publish_time=1), b"payload"))
        else:
            frames.append(encode_command(cmd))
    return frames


def _fill_required(message: Any) -> None:
    for field in message.DESCRIPTOR.fields:
        if not field.is_required:
            continue
        if field.message_type is not None:
            _fill_required(getattr(message, field.name))
        elif field.enum_type is not None:
            setattr(message, field.name, field.enum_type.values[0].number)
        elif field.type in (field.TYPE_STRING,):
            setattr(message, field.name, "x")
        elif field.type == field.TYPE_BYTES:
            setattr(message, field.name, b"x")
        elif field.type == field.TYPE_BOOL:
            setattr(message, field.name, True)
        else:
            setattr(message, field.name, 1)


def client_frames() -> list[bytes]:
    """Every frame of the official client's captures (both directions)."""
    vectors = json.loads(VECTORS.read_text())
    return [base64.b64decode(frame["raw_b64"]) for scenario in vectors["scenarios"] for frame in scenario["frames"]]


#: the inputs of issue #12, as found by the first fuzz run and the trial
ISSUE_INPUTS = [
    bytes.fromhex("0000000d0000000808063204080110010e") + b"\x00",            # the one-frame hang
    bytes.fromhex("000000180000001408") + b"\x0b\x5a\x7f" + bytes(17),       # FLOW whose sub-command overruns
    b"\x00\x00\x00\x00",                                                      # TOTAL_SIZE 0
    b"\x00\x00\x00\x10\x00\x00\x00\x00",                                      # CMD_SIZE 0
]


def corpus() -> list[bytes]:
    frames = client_frames() + one_of_every_type()
    unique: dict[bytes, None] = dict.fromkeys(frames)
    return list(unique) + ISSUE_INPUTS


def seeds() -> Iterator[bytes]:
    """Corpus inputs for every target: single frames, runs of frames, the issue's inputs."""
    frames = corpus()
    for index, frame in enumerate(frames):
        for target in range(len(TARGETS)):
            yield encode_input(target, index & 0xFF, [len(frame) // 2], frame)
    runs = [b"".join(frames[i:i + 4]) for i in range(0, len(frames), 4)]
    for index, run in enumerate(runs):
        yield encode_input(0, index, [7, 300, 1000], run)
        yield encode_input(2, index, [], run)


# -- the targets -----------------------------------------------------------------------------
T = api.BaseCommand
#: the wanted sets an input can choose (two flag bits); a third bit sets want_all
WANTED_CHOICES: tuple[frozenset[int], ...] = (frozenset(), frozenset({T.PING, T.PONG, T.CONNECT}),
                  frozenset({T.SEND, T.MESSAGE, T.FLOW, T.LOOKUP_RESPONSE, T.ACK}), frozenset(TYPE_NAMES))


class Mismatch(AssertionError):
    """The scanner and the decoder disagree, or a target broke its contract."""


def decoder_verdict(chunks: list[bytes], limit: int = LIMIT) -> tuple[bytes, str | None]:
    """The frames FrameDecoder returns (joined) and its error (``Type: message``), if any."""
    decoder = FrameDecoder(limit)
    frames = bytearray()
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            while (frame := decoder.next_frame()) is not None:
                frames += frame.raw
        decoder.close()
    except ProtocolError as exc:
        return bytes(frames), f"{type(exc).__name__}: {exc}"
    return bytes(frames), None


def scanner_verdict(chunks: list[bytes], wanted: frozenset[int], want_all: bool,
                    limit: int = LIMIT) -> tuple[bytes, list[Frame], str | None]:
    """What the scanner let through (joined), the Frames it handed out, and its error, if any."""
    from proxy.core.scanner import FrameScanner

    scanner = FrameScanner(limit, wanted, want_all=want_all)
    passed = bytearray()
    frames: list[Frame] = []

    def take(pieces: list[Any]) -> None:
        nonlocal passed
        for piece in pieces:
            if isinstance(piece, Frame):
                frames.append(piece)
                passed += piece.raw
            else:
                passed += piece

    try:
        for chunk in chunks:
            take(scanner.feed(chunk))
        scanner.close()
    except ProtocolError as exc:
        take(scanner.passed_before_error)  # what of the failing read goes on before the error
        return bytes(passed), frames, f"{type(exc).__name__}: {exc}"
    return bytes(passed), frames, None


def check_frames(data: bytes, cuts: list[int], flags: int) -> None:
    """The scanner's verdict is the decoder's, for this split and choice of wanted types."""
    chunks = split(data, cuts)
    wanted = WANTED_CHOICES[flags & 3]
    want_all = flags & 4 != 0
    decoded, decoder_error = decoder_verdict(chunks)
    passed, frames, scanner_error = scanner_verdict(chunks, wanted, want_all)
    if decoder_error != scanner_error:
        raise Mismatch(f"decoder: {decoder_error}; scanner: {scanner_error}")
    if not data.startswith(passed):
        raise Mismatch("the scanner let through bytes that are not a prefix of the input")
    if decoder_error is None and (passed != data or decoded != data):
        raise Mismatch("a clean stream did not come through whole")
    if decoder_error is not None and "closed mid-frame" not in decoder_error and passed != decoded:
        # the decoder returned every frame before the failing one: exactly those pass, nothing of
        # that one (only a frame whose checks passed streams through, and a peer may stop in its middle)
        if len(passed) > len(decoded):
            raise Mismatch(f"the scanner let through {len(passed) - len(decoded)} bytes of the failing frame")
        raise Mismatch(f"the scanner held back {len(decoded) - len(passed)} bytes of the good frames before it")
    expected = [f for f in _frames_of(decoded) if want_all or f.type in wanted]
    if [f.raw for f in frames] != [f.raw for f in expected][:len(frames)]:
        raise Mismatch("the scanner handed out other frames than the wanted ones")


def _frames_of(data: bytes) -> list[Frame]:
    decoder = FrameDecoder(LIMIT)
    decoder.feed(data)
    return list(decoder.frames())


def check_codec(data: bytes) -> None:
    """Decode everything the decoder accepts; render it as recordings are rendered."""
    from proxy.protocol.message import decode_messages
    from proxy.recording.reader import RecordedFrame
    from proxy.recording.redaction import redact
    from proxy.recording.show import format_entry
    from proxy.recording.timeline import TimelineBuilder

    decoder = FrameDecoder(LIMIT)
    with contextlib.suppress(ProtocolError):
        for frame in decoder.receive(data):
            with contextlib.suppress(ProtocolError):
                frame.sub.ListFields()
                section = frame.payload
                if section is not None:
                    section.checksum_ok()
                    section.broker_entry_metadata  # noqa: B018 - decoding is the point
                    decode_messages(section.metadata, section.payload)
    # the same bytes as a recording holds them: never an exception, whatever they are
    builder = TimelineBuilder()
    for conn, piece in enumerate(split(data, [len(data) // 2])):
        recorded = RecordedFrame(conn % 2, "to_broker", "client", 1, piece, len(piece))
        entry = builder.entry(recorded)
        json.dumps(entry.to_json())
        format_entry(entry, color=False)
        redact(piece)


@functools.cache
def _rules() -> Any:
    from proxy.rules.loader import load_rules_text

    return load_rules_text(
        "seed: 1\nrules:\n"
        "  - {name: topics, match: {topic: {regex: 'persistent://.*'}, probability: 0.5}, action: {mark: {}}}\n"
        "  - {name: names, match: {producer_name: 'p*', subscription: 's*'}, action: {delay: {ms: 1}}}\n"
        "  - {name: all, match: {after: 3}, action: {record: {}}}\n")


def check_pipeline(data: bytes, cuts: list[int], flags: int) -> None:
    """The relay of one connection: only ProtocolErrors, and nothing more after one."""
    from proxy.config.proxy_config import ServiceUrl
    from proxy.core.hooks import ConnectionEvent, ConnectionInfo, FrameEvent, RunEvent
    from proxy.core.lookup import BrokerDirectory
    from proxy.core.pipeline import ConnectionPipeline, PipelineSettings
    from proxy.protocol.session import Direction
    from proxy.rules.engine import RulesEngine
    from proxy.rules.hook import RulesHook

    rules = _rules()
    events: list[FrameEvent | RunEvent | ConnectionEvent] = []
    directory = BrokerDirectory("127.0.0.1", upstream_tls=False, open_listener=lambda broker: 40000)
    pipeline = ConnectionPipeline(
        ConnectionInfo(1, "127.0.0.1:5555", "127.0.0.1:6650", None),
        settings=PipelineSettings(max_frame_bytes=LIMIT, verify_checksums=bool(flags & 1)),
        directory=directory, default_broker=ServiceUrl.parse("pulsar://127.0.0.1:6650"), now_ns=0,
        hook=RulesHook(RulesEngine(rules)) if flags & 2 else None,
        publish=events.append if flags & 4 else None)
    connect = encode_command(api.CommandConnect(client_version="fuzz", protocol_version=21))
    connected = encode_command(api.CommandConnected(server_version="fuzz", protocol_version=21))
    now = 0
    failed: set[Direction] = set()
    steps = [(Direction.TO_BROKER, connect), (Direction.TO_CLIENT, connected)]
    for index, chunk in enumerate(split(data, cuts)):
        steps.append((Direction.TO_CLIENT if (flags >> 3 + index % 5) & 1 else Direction.TO_BROKER, chunk))
    for direction, chunk in steps:
        now += 1_000_000
        if failed:
            break
        try:
            pipeline.receive(direction, chunk, now)
            pipeline.release_due(now)
            pipeline.tick(now)
        except ProtocolError:
            failed.add(direction)
            with contextlib.suppress(ProtocolError):
                pipeline.receive(direction, b"", now)  # a failed scanner stays failed
    for direction in (Direction.TO_BROKER, Direction.TO_CLIENT):
        with contextlib.suppress(ProtocolError):
            pipeline.peer_closed(direction)


def run_one(raw: bytes) -> None:
    target, flags, cuts, data = decode_input(raw)
    if target == 0:
        check_frames(data, cuts, flags)
    elif target == 1:
        check_codec(data)
    else:
        check_pipeline(data, cuts, flags)


# -- the split-frame family sweep ------------------------------------------------------------
class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"still running after {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def family_frames() -> list[bytes]:
    """One corpus frame per layout (command type, a one- or two-byte sub-command length, payload
    section with or without broker entry metadata), and the issue's inputs: the frames whose cuts differ."""
    shapes: dict[tuple[int, int, int], bytes] = {}
    for frame in corpus():
        if len(frame) < 10:
            shapes[(-1, len(frame), 0)] = frame
            continue
        cmd_size = int.from_bytes(frame[4:8], "big")
        section = frame[8 + cmd_size:8 + cmd_size + 2]
        shapes.setdefault((frame[9], cmd_size >= 132, section[1] if len(section) == 2 else 0), frame)
    return list(shapes.values())


def split_family() -> Iterator[bytes]:
    """Every corpus frame, alone and followed by one more byte, cut everywhere it matters.

    Once its head is checked, a frame's bytes pass through unexamined, so the cuts that
    matter are in the head (sizes, command, payload section: the first 64 bytes) and
    at the end: every single cut there, and every pair of cuts in the first 14 bytes.
    """
    for index, frame in enumerate(family_frames()):
        for data in (frame, frame + b"\x00"):
            singles = sorted(set(range(1, min(len(data), 64))) | set(range(max(1, len(data) - 12), len(data))))
            for cut in singles:
                yield encode_input(0, index, [cut], data)
            for first in range(1, min(len(data) - 1, 14)):
                for second in range(first + 1, min(len(data), 15)):
                    yield encode_input(0, index, [first, second], data)


def sweep(inputs: Iterator[bytes], hang_seconds: float, artifacts: Path, budget_s: float) -> dict[str, Any]:
    started = time.monotonic()
    count, crashes, hangs = 0, 0, 0
    for raw in inputs:
        if time.monotonic() - started > budget_s:
            break
        count += 1
        try:
            with deadline(hang_seconds):
                run_one(raw)
        except Hang:
            hangs += 1
            _keep(artifacts, "hang", raw, traceback.format_exc())
        except Exception:
            crashes += 1
            _keep(artifacts, "crash", raw, traceback.format_exc())
    return {"inputs": count, "crashes": crashes, "hangs": hangs, "seconds": time.monotonic() - started}


def _keep(artifacts: Path, kind: str, raw: bytes, text: str) -> None:
    artifacts.mkdir(parents=True, exist_ok=True)
    name = f"{kind}-{len(list(artifacts.glob(kind + '-*.bin')))}"
    (artifacts / f"{name}.bin").write_bytes(raw)
    (artifacts / f"{name}.txt").write_text(text)
    print(f"{kind}: {artifacts / name}.bin\n{text.strip().splitlines()[-1]}", flush=True)


# -- atheris ---------------------------------------------------------------------------------
def child_main(args: argparse.Namespace) -> None:
    """Runs in the child: libFuzzer drives :func:`run_one` (exits when done or on a crash)."""
    import atheris

    with atheris.instrument_imports(include=["proxy"]):
        pass

    def one_input(raw: bytes) -> None:
        run_one(raw)

    atheris.Setup([sys.argv[0], *args.libfuzzer], one_input)
    atheris.Fuzz()


def fuzz(args: argparse.Namespace) -> dict[str, Any]:
    """atheris in a child process; returns the counts libFuzzer reports."""
    args.artifacts.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pulsar-tap-fuzz-") as tmp:
        corpus_dir = Path(tmp) / "corpus"
        corpus_dir.mkdir()
        for index, raw in enumerate(seeds()):
            (corpus_dir / f"seed-{index}").write_bytes(raw)
        options = [f"-timeout={max(1, int(args.hang_seconds))}", f"-artifact_prefix={args.artifacts}/",
                   "-rss_limit_mb=4096", "-max_len=4096", "-print_final_stats=1", f"-seed={args.seed}"]
        options.append(f"-runs={args.runs}" if args.runs else f"-max_total_time={max(1, int(args.seconds))}")
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "--", *options, str(corpus_dir)]
        started = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
        elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", output)
    done = re.findall(r"Done (\d+) runs", output)
    count = int(runs[-1]) if runs else int(done[-1]) if done else 0
    hang = "ALARM: working on the last Unit" in output or "-timeout-" in output
    crash = result.returncode != 0 and not hang
    if result.returncode != 0:
        (args.artifacts / "fuzz-output.txt").write_text(output)
        print(output[-4000:], flush=True)
    return {"inputs": count, "crashes": int(crash), "hangs": int(hang), "seconds": elapsed}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        parsed = argparse.Namespace(libfuzzer=argv[2:] if argv[1:2] == ["--"] else argv[1:])
        child_main(parsed)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--runs", type=int, default=0, help="fuzz this many inputs (the long mode: 1000000)")
    mode.add_argument("--seconds", type=float, default=30.0, help="fuzz for this long (default 30)")
    parser.add_argument("--hang-seconds", type=float, default=5.0, help="an input running longer is a hang")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed (0: a new one)")
    parser.add_argument("--artifacts", type=Path, default=Path("fuzz-artifacts"),
                        help="where crashing and hanging inputs are kept")
    parser.add_argument("--no-sweep", action="store_true", help="skip the split-frame family sweep")
    args = parser.parse_args(argv)
    args.artifacts = args.artifacts.resolve()
    rows: list[tuple[str, dict[str, Any]]] = []
    if not args.no_sweep:
        budget = float("inf")  # the whole family, always
        print("sweeping the split-frame family ...", flush=True)
        rows.append(("split-frame sweep", sweep(split_family(), args.hang_seconds, args.artifacts, budget)))
        if args.seconds and not args.runs:
            args.seconds = max(args.seconds - rows[-1][1]["seconds"], 5.0)
    print("fuzzing with atheris ...", flush=True)
    rows.append(("atheris (3 targets)", fuzz(args)))
    print(f"\n{'phase':<22}{'inputs':>12}{'crashes':>9}{'hangs':>7}{'seconds':>9}{'inputs/s':>10}")
    for name, row in rows:
        rate = row["inputs"] / row["seconds"] if row["seconds"] else 0.0
        print(f"{name:<22}{row['inputs']:>12,}{row['crashes']:>9}{row['hangs']:>7}{row['seconds']:>9.1f}{rate:>10,.0f}")
    failed = any(row["crashes"] or row["hangs"] for _, row in rows)
    total = sum(row["inputs"] for _, row in rows)
    print(f"\n{total:,} inputs, {'FAILED: see ' + str(args.artifacts) if failed else 'no crash, no hang'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
