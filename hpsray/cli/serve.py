"""``hpsray serve MODEL_DIR``: serve an exported model over HTTP on Ray Serve (docs/serving.md).

    hpsray serve out/model --port 8000 --replicas 2 --mem-fraction 0.05
    curl -s -d '{"examples": [{"I1": 0.5, "C1": 17, ...}]}' http://127.0.0.1:8000/predict

MODEL_DIR is an export (``hpsray train JOB.toml --export DIR``) or a directory of exports, of
which the newest is served; a newer export appearing there is swapped in without downtime.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from hpsray.errors import PrivateControlFlow

HELP = "serve an exported model on Ray Serve: POST /predict with raw feature values (docs/serving.md)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="an export directory, or a directory of exports")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--replicas", type=int, default=1, help="model replicas (default 1)")
    mem = parser.add_mutually_exclusive_group()
    mem.add_argument(
        "--mem-rows",
        type=int,
        default=None,
        metavar="R",
        help="rows held in memory per replica; the rest is read from SSD (default: all)",
    )
    mem.add_argument(
        "--mem-fraction", type=float, default=None, metavar="F", help="fraction of the rows held in memory, e.g. 0.05"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument(
        "--device-rows",
        type=int,
        default=None,
        metavar="R",
        help="with --device cuda: the hottest rows held in device memory, in front of the memory rows "
        "(default: the memory rows, at most a quarter of the GPU's free memory; 0: none)",
    )
    parser.add_argument(
        "--driver",
        choices=("cpu", "device"),
        default="cpu",
        help="device: the device-driven lookup (one upload of the keys; dedupe, probes and gathers on the "
        "device; docs/serving.md); cpu: the host dedupes and probes (default)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    parser.add_argument("--max-examples", type=int, default=1024, help="most examples per request (default 1024)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests per dynamic batch (default 16)")
    parser.add_argument(
        "--watch",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between looks for a newer export (0: never; default 2)",
    )
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: start a local one)")


class _Stop(PrivateControlFlow):
    """A SIGTERM or SIGINT arrived: stop serving (``signum`` says which); raised by the signal
    handler, caught by :func:`run`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_RECEIVED: list[int] = []  # the signals that arrived: a _Stop raised where Ray catches it is not lost
_DEFERRING: list[bool] = []  # non-empty while Ray starts its processes: a first signal is only recorded


def _raise_stop(signum: int, frame: object) -> None:
    _RECEIVED.append(signum)
    if _DEFERRING and len(_RECEIVED) == 1:  # raised inside ray.init, its C++ side may abort (SIGABRT)
        return
    raise _Stop(signum)


def _stop_if_signalled() -> None:
    """Raise the :class:`_Stop` of a signal whose exception code it interrupted swallowed (Ray's
    start catches what is raised while it starts its processes)."""
    if _RECEIVED:
        raise _Stop(_RECEIVED[0])


def _quiet_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """Drop a :class:`_Stop` that Python could not raise (a signal arriving in an at-fork hook or a
    finalizer prints "Exception ignored"): :data:`_RECEIVED` holds it and
    :func:`_stop_if_signalled` raises it again; anything else goes to Python's own hook."""
    if isinstance(unraisable.exc_value, _Stop):
        return
    sys.__unraisablehook__(unraisable)


def _on_signals() -> None:
    """SIGTERM and SIGINT raise :class:`_Stop` in the main thread (Python's handler in place of
    Ray's, whose SIGTERM handler prints a C++ stack dump)."""
    sys.unraisablehook = _quiet_unraisable
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_stop)


def _shutdown(local: bool, name: str) -> None:
    """Stop what this command started, ignoring further signals meanwhile: a local Ray (Serve
    with it) is shut down; on a cluster it joined, only its application is deleted."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ray

        connected = ray.is_initialized()
    except Exception:  # noqa: BLE001 - stopped while Ray was being imported: nothing of it runs yet
        return
    if not connected:
        return
    try:
        if not local:
            from ray import serve

            serve.delete(name)
    finally:
        ray.shutdown()  # a local Ray's processes, Serve's among them, end with it


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT (Ctrl-C), then stop Serve and Ray: exit 0 once it served,
    128 + the signal's number when stopped while deploying; 2 for a bad model or option."""
    from hpsray.errors import ServingError
    from hpsray.fields import same_fields
    from hpsray.serving import Limits, ServeOptions, resolve_export, start
    from hpsray.serving.server import connect_ray, load_options

    try:
        limits = Limits(args.max_body_bytes, args.max_examples)
        options = ServeOptions(**same_fields(ServeOptions, args, limits=limits, watch_s=args.watch))
        load_options(options)  # its checks, before Ray starts
        resolve_export(args.model_dir)  # before Ray starts: a wrong directory fails in a second
    except (ServingError, ValueError) as e:
        print(f"hpsray serve: {e}", file=sys.stderr)
        return 2
    serving, local = False, args.address is None
    _on_signals()
    try:
        print(f"hpsray serve: deploying {args.model_dir} ...", file=sys.stderr, flush=True)
        _DEFERRING.append(True)  # a first signal while Ray starts stops it once it is up; a second, at once
        try:
            local = connect_ray(args.address) and args.address is None
        finally:
            _DEFERRING.clear()
        _on_signals()  # again: starting Ray installed its own SIGTERM handler (a C++ stack dump)
        _stop_if_signalled()
        start(args.model_dir, options, address=args.address)
        _stop_if_signalled()
        serving = True
        url = f"http://{args.host}:{args.port}"
        print(f"serving {args.model_dir} at {url}/predict, metrics at {url}/metrics (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except (_Stop, KeyboardInterrupt) as e:
        name = str(e) if isinstance(e, _Stop) else "SIGINT"
        signum = e.signum if isinstance(e, _Stop) else int(signal.SIGINT)
        print(f"hpsray serve: {name}: stopping{'' if serving else ' (while deploying)'}", file=sys.stderr, flush=True)
        _shutdown(local, options.name)
        print("hpsray serve: stopped", file=sys.stderr, flush=True)
        return 0 if serving else 128 + signum
    except (ServingError, ValueError) as e:
        _shutdown(local, options.name)
        print(f"hpsray serve: {e}", file=sys.stderr)
        return 2
