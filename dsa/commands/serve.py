"""``dsa serve``: the OpenAI-compatible HTTP server (needs the ``serve`` extra: FastAPI, uvicorn).

Binds 127.0.0.1 by default; logs one line per request, and a stats line every 10 s while busy.
SIGTERM or Ctrl-C drain it: new requests get 503, requests in flight get ``--shutdown-timeout``
seconds, then are aborted (a stream ends with a chunk whose ``finish_reason`` is ``"abort"``, then
``data: [DONE]``), and the process exits 0. A second signal ends every request at once, in the
same way (no waiting for the engine's step), and the process exits 0; later signals are ignored.

``--tp N`` under ``torchrun --nproc-per-node N``: every rank holds a shard of the model; rank 0
serves HTTP and broadcasts each step's requests and aborts to the others, which apply them and step
along (:mod:`dsa.serve.tp_commands`) and ignore SIGINT / SIGTERM (they stop when rank 0 does). A
rank that dies or hangs (``TIMEOUT_S``) stops every rank with one line on stderr and exit status 1.
To stop it, signal the workers (``kill -TERM`` their pids): every rank exits 0, and so does torchrun.
A signal to torchrun itself reaches the workers too (torchrun forwards it: rank 0 drains), but
torchrun's agent then exits 1 with a ``SignalException`` traceback (its own behaviour), and kills
workers still running after its ``--shutdown-timeout`` (default 30 s).
"""
import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import sys

from dsa.commands.options import (
    add_model_arguments,
    add_preset_argument,
    add_speculative_argument,
    device_from_args,
    llm_from_args,
)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install -e '.[serve]')")
    add_model_arguments(p)
    add_speculative_argument(p)
    add_preset_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--api-key", default=os.environ.get("DSA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DSA_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint folder's "
                   "name, or dsa-default)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, help="seconds requests in flight get at "
                   "shutdown (SIGTERM, Ctrl-C) before they are aborted; a second signal aborts them at once "
                   "(default: %(default)s)")
    p.add_argument("--max-queued", type=int, help="a request arriving while this many requests wait (not yet "
                   "running) gets 503 with Retry-After (default: no limit)")
    p.add_argument("--request-timeout", type=float, help="seconds after which a request still running is "
                   "aborted (default: none)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one process each: start with "
                   "torchrun --nproc-per-node N -m dsa serve --tp N; rank 0 serves HTTP (default: %(default)s)")
    p.set_defaults(func=run)


def _die(message: str) -> None:
    """One line on stderr and exit 1 now: the process group may be stuck, and so may its teardown."""
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


def run(args) -> int:
    check_options(args)
    device_from_args(args, "serve")
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"dsa serve: needs {' and '.join(missing)}; install the extra with "
                         "pip install 'deepseek-sparse-attention[serve]'")
    from dsa.serve.engine_loop import EngineLoop
    from dsa.serve.host_memory import freeze_after_warmup
    from dsa.serve.openai_server import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.tp > 1:
        start_ranks(args.tp)
    llm = llm_from_args(args, "serve")  # warmed up
    logging.getLogger("dsa.serve").info("gc.freeze() after the warm-up: %d objects frozen", freeze_after_warmup())
    commands = None
    if args.tp > 1:
        from dsa.serve.tp_commands import TPCommands
        commands = TPCommands(llm.model.tp)
        if commands.rank != 0:
            return follow_rank_0(llm, commands)
    log_ready(llm)
    loop = EngineLoop(llm.engine, tp=commands)
    app = build_app(llm, loop, served_name(args), args.api_key, args.max_queued, args.request_timeout)
    serve_until_stopped(app, loop, args)
    if loop.fatal is not None:
        _die(f"dsa serve: {loop.fatal}")
    if commands is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


def check_options(args) -> None:
    for flag, value, minimum in (("--shutdown-timeout", args.shutdown_timeout, 0), ("--max-queued", args.max_queued, 0),
                                 ("--request-timeout", args.request_timeout, 1e-9), ("--tp", args.tp, 1)):
        if value is not None and not value >= minimum:
            raise SystemExit(f"dsa serve: {flag} must be {'positive' if minimum else 'at least 0'}, got {value}")


def start_ranks(tp: int) -> None:
    """Join the ``torchrun`` process group of ``tp`` ranks (one line when it cannot be started or has
    another size)."""
    import torch.distributed as dist

    from dsa.model.parallel import start_process_group
    from dsa.serve.tp_commands import TIMEOUT_S
    try:
        start_process_group(tp, timeout_s=TIMEOUT_S)
    except RuntimeError as e:
        raise SystemExit(f"dsa serve: --tp {tp}: {e}") from None
    if dist.get_world_size() != tp:
        raise SystemExit(f"dsa serve: --tp {tp}: torchrun started {dist.get_world_size()} processes")


def follow_rank_0(llm, commands) -> int:
    """A rank other than 0: apply rank 0's commands until it sends the stop. It ignores SIGINT and
    SIGTERM (rank 0 drains, then sends the stop), and dies with one line when rank 0 dies or hangs."""
    import torch.distributed as dist

    from dsa.serve.tp_commands import follow, one_line
    logging.getLogger().setLevel(logging.WARNING)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        follow(llm.engine, commands)
    except Exception as e:  # noqa: BLE001 - rank 0 died or hangs, or the ranks diverged
        _die(f"dsa serve: tensor-parallel rank {commands.rank}: stopped: {one_line(e)}")
    dist.destroy_process_group()
    return 0


def log_ready(llm) -> None:
    """The loaded model's CPU threads and warm-up, one log line each (when there are any)."""
    log = logging.getLogger("dsa.serve")
    if llm.cpu_threads is not None:
        from dsa.engine.cpu_threads import describe
        log.info("torch on CPU: %s", describe(llm.cpu_threads, llm.cpu_threads_reason))
    if llm.warmup_report is not None:
        r = llm.warmup_report
        cache = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
        log.info("warm-up done in %.1f s: %d prefill shapes, %d CUDA graphs (%.0f MiB), %d kernel variants built; "
                 "Triton's cache: %s", r["seconds"], r["prefill_steps"], r["graphs_captured"],
                 r["graph_pool_bytes"] / 2**20, r["kernel_variants"], cache)


def served_name(args) -> str:
    """The model id clients send: ``--served-model-name``, else the checkpoint folder's name, else
    ``dsa-PRESET`` or ``dsa-default``."""
    if args.served_model_name:
        return args.served_model_name
    if args.checkpoint:
        return os.path.basename(os.path.normpath(args.checkpoint))
    return f"dsa-{args.preset}" if args.preset else "dsa-default"


def serve_until_stopped(app, loop, args) -> None:
    """Run uvicorn on ``--host``/``--port`` until a signal has drained the app or the engine loop
    failed (``loop.on_fatal``); then ignore the signals: what is left is the exit (Python's own
    teardown would restore the default handlers, and a signal kill it)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn with its own signal handling. The first SIGTERM / Ctrl-C drains the app, then
        stops it (uvicorn would cancel the requests in flight and re-raise the signal: exit 143);
        the second ends every request at once, each stream with its last chunk (uvicorn would cut
        the streams and print each one's CancelledError); later ones change nothing. The handlers
        are set before the event loop starts and the signals ignored once it has stopped (uvicorn
        would restore the previous handlers, where a late Ctrl-C raises KeyboardInterrupt)."""

        event_loop = None
        signals = 0

        @contextlib.contextmanager
        def capture_signals(self):  # serve_until_stopped sets the handlers
            yield

        async def serve(self, sockets=None):
            self.event_loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):  # a signal handler: hand the work to the event loop
            self.signals += 1
            if self.event_loop is None:  # not serving yet: nothing to drain
                self.should_exit = True
            elif self.signals <= 2:
                with contextlib.suppress(RuntimeError):  # the loop has just closed: nothing left to end
                    self.event_loop.call_soon_threadsafe(self.start_drain if self.signals == 1
                                                         else app.state.end_now)

        def start_drain(self):
            self.drain_task = asyncio.ensure_future(self.drain())

        async def drain(self):
            await app.state.drain(args.shutdown_timeout)
            self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5.0)
    server = Server(config)
    loop.on_fatal = lambda reason: setattr(server, "should_exit", True)  # uvicorn polls it
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    server.run()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
