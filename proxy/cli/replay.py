"""``pulsar-tap replay``: client-side replay with a response diff, or broker-side replay (``--serve``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from proxy.wording import counted

NAME = "replay"
#: a server process: numpy's BLAS keeps to one thread (see proxy.native_threads)
ONE_THREAD = True
HELP = "replay a recording against a broker, or serve it to live clients as a broker"
DESCRIPTION = """\
Client-side replay (default): re-enact the recorded clients against the broker at
--upstream — lookups redone, producer/consumer/request ids remapped, messages
re-published with their payloads, keys and properties, FLOW/ACK re-issued, the
original pacing scaled by --speed (0: as fast as possible) — and print one line per
request whose answer differs:
  DIFF conn=N COMMAND topic=T recorded=OUTCOME replayed=OUTCOME
(OUTCOME: ok, error:CODE, unanswered, not-sent).  Message ids, generated names
and timing are not differences.  Progress goes to stderr once a second (recorded
time reached, requests replayed); --quiet turns it off.  SIGINT/SIGTERM stop the
replay: the answers to what was sent are awaited briefly and the diff so far is
printed (a second signal stops at once).

Broker-side replay (--serve): listen at --listen and answer any number of live
clients from the recording, requests matched by command and key fields (topic,
subscription, producer name, message order), never by ids; lookups point at this
server; recorded MESSAGEs are pushed within the consumer's FLOW permits.  Requests
the recording cannot answer get ERROR UnknownError "not in recording" (--unmatched
error, the default), are relayed to --upstream (forward), or close the connection
(close).  Prints "ready: listening on HOST:PORT"; SIGINT/SIGTERM stop it with a
summary of what it served (exit 0).

A damaged recording is read around the damage (one warning line on stderr says
what was skipped); the requests it lost are not replayed.

examples:
  pulsar-tap replay recordings/sample --upstream pulsar://127.0.0.1:6650 --speed 0
  pulsar-tap replay REC --upstream pulsar://broker:6650 --speed 2
  pulsar-tap replay recordings/sample --serve --listen 127.0.0.1:6650
  pulsar-tap replay REC --serve --listen 127.0.0.1:6650 --unmatched forward --upstream pulsar://broker:6650
"""
EPILOG = """\
exit status:
  0    client-side: every replayed request got the recorded kind of answer;
       --serve: stopped by SIGINT/SIGTERM
  1    client-side: differences (the DIFF lines on stdout)
  2    bad arguments, no recording at REC, an upstream that cannot be reached, a busy --listen port
  130  client-side replay stopped by SIGINT/SIGTERM before the end: the DIFF lines cover only
       the requests replayed until then
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", metavar="REC", help="recording directory, or a parent of several")
    parser.add_argument("--upstream", metavar="URL",
                        help="the broker to replay against (client-side), or to forward to (--serve)")
    parser.add_argument("--speed", type=float, default=1.0, metavar="X",
                        help="pacing: recorded gaps divided by X; 0 = as fast as possible (default 1)")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="seconds to wait for each answer and for the last receipts (default 10)")
    parser.add_argument("--token", metavar="TOKEN", help="auth token for the upstream (client-side)")
    parser.add_argument("--serve", action="store_true", help="broker-side replay: act as the broker")
    parser.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:6650",
                        help="where --serve listens (default 127.0.0.1:6650; port 0 picks one)")
    parser.add_argument("--advertise", metavar="HOST", help="host written into lookup answers (default: listen host)")
    parser.add_argument("--unmatched", choices=("error", "forward", "close"), default="error",
                        help="what --serve does with requests the recording cannot answer (default error)")
    parser.add_argument("--ready-file", metavar="PATH", help="--serve: write the listening port as JSON once ready")
    parser.add_argument("--quiet", action="store_true", help="client-side: no progress lines on stderr")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning",
                        help="log level of the log lines on stderr")


def run(args: argparse.Namespace) -> int:
    from proxy.errors import UsageError
    from proxy.telemetry.logs import configure_logging

    if args.speed < 0:
        raise UsageError("--speed must be 0 or more")
    if args.timeout <= 0:
        raise UsageError("--timeout must be more than 0")
    configure_logging("console", args.log_level)
    if args.serve:
        return _serve(args)
    if not args.upstream:
        raise UsageError("give --upstream URL (client-side replay) or --serve (broker-side replay)")
    return _replay(args)


def _replay(args: argparse.Namespace) -> int:
    import trio

    from proxy.cli.interrupt import EXIT_INTERRUPTED, on_signals
    from proxy.client.names import parse_service_url
    from proxy.replay.client_side import ReplayResult, load_conversations
    from proxy.replay.replayer import ClientReplayer

    parse_service_url(args.upstream)  # a bad URL is a usage error before anything is read
    conversations, report = load_conversations(args.recording)
    _warn(report)
    replayer = ClientReplayer(conversations, args.upstream, speed=args.speed, operation_timeout=args.timeout,
                              receipt_timeout=args.timeout, token=args.token)

    async def main() -> ReplayResult | None:
        result: ReplayResult | None = None
        with trio.CancelScope() as everything:

            def on_signal(count: int) -> None:
                if count == 1:
                    print("replay: stopping: waiting briefly for the answers to what was sent "
                          "(a second signal stops at once)", file=sys.stderr, flush=True)
                    replayer.stop()
                else:
                    everything.cancel()

            with on_signals(on_signal):
                async with trio.open_nursery() as nursery:
                    if not args.quiet:
                        nursery.start_soon(_progress, replayer)
                    result = await replayer.run()
                    nursery.cancel_scope.cancel()
        return result

    result = trio.run(main)
    if result is None:
        print(f"replay: stopped at once after {replayer.result.requests} of "
              f"{counted(replayer.requests_total, 'request')}: "
              "no diff", file=sys.stderr)
        return EXIT_INTERRUPTED
    for diff in result.diffs:
        print(diff.format())
    handled = (f" ({result.proxy_handled} answered or swallowed by the proxy when recorded: not replayed)"
               if result.proxy_handled else "")
    if result.stopped:
        print(f"replay: stopped by a signal after {result.requests} of {counted(replayer.requests_total, 'request')}: "
              f"{counted(len(result.diffs), 'differs', 'differ')} so far{handled}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"replayed {counted(result.requests, 'request')}: {counted(len(result.diffs), 'differs', 'differ')}{handled}",
          file=sys.stderr)
    return 1 if result.diffs else 0


async def _progress(replayer: object) -> None:
    """One line a second on stderr: recorded time reached and requests replayed."""
    import trio

    from proxy.replay.replayer import ClientReplayer

    assert isinstance(replayer, ClientReplayer)
    started = trio.current_time()
    while True:
        await trio.sleep(1)
        print(f"replay: [{trio.current_time() - started:6.1f}s] recorded time {replayer.position_ns / 1e9:.1f} s "
              f"of {replayer.span_ns / 1e9:.1f} s, {replayer.result.requests} of {replayer.requests_total} "
              "requests replayed", file=sys.stderr, flush=True)


def _warn(report: object) -> None:
    from proxy.recording.reader import ReadReport

    assert isinstance(report, ReadReport)
    warning = report.summary()
    if warning:
        print(f"pulsar-tap replay: warning: {warning}", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    import trio

    from proxy.cli.heap import settle_heap
    from proxy.cli.interrupt import on_signals
    from proxy.client.names import parse_service_url
    from proxy.config.proxy_config import HostPort
    from proxy.errors import PulsarTapError, UsageError
    from proxy.recording.reader import open_recordings
    from proxy.replay.conversation import build_conversations
    from proxy.replay.matcher import AnswerBook
    from proxy.replay.server import ReplayServer

    try:
        listen = HostPort.parse(args.listen)
    except ValueError as exc:
        raise UsageError(f"--listen: {exc}") from None
    if args.upstream:
        parse_service_url(args.upstream)
    from proxy.cli.ports import check_can_listen

    check_can_listen(listen.host, listen.port, "--listen")
    recordings = open_recordings(args.recording)
    book = AnswerBook.from_conversations(build_conversations(recordings.frames()).values())
    _warn(recordings.report)
    server = ReplayServer(book, listen.host, listen.port, unmatched=args.unmatched, upstream=args.upstream,
                          advertise=args.advertise)

    async def main() -> None:
        with trio.CancelScope() as everything:

            def on_signal(count: int) -> None:
                server.request_shutdown()
                if count > 1:
                    everything.cancel()

            with on_signals(on_signal):
                async with trio.open_nursery() as nursery:
                    try:
                        address: str = await nursery.start(server.run)
                    except OSError as exc:  # the nursery wraps it in a group; main() finds it there
                        raise PulsarTapError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
                    print(f"ready: listening on {address}", flush=True)
                    if args.ready_file:
                        _write_ready_file(args.ready_file, address)
                    settle_heap()  # (the answer book lives as long as the server: see proxy.cli.heap)

    trio.run(main)
    stats = server.stats
    print(f"replay: served {counted(stats.connections, 'connection')}: {counted(stats.answered, 'request')} answered "
          f"from the recording, {stats.unmatched} not in it, {counted(stats.messages_pushed, 'message')} pushed",
          file=sys.stderr)
    return 0


def _write_ready_file(path: str, address: str) -> None:
    Path(path).write_text(json.dumps({"listen": [address], "admin": None}) + "\n")
