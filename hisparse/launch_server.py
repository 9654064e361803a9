"""`python -m hisparse.launch_server --port 30000 [--enable-hisparse ...]`: the OpenAI-compatible server.

Flags are checked (and the port tried) before the model loads, so mistakes fail in a second with one line.
The engine loop runs in the main thread, which loaded the model, and uvicorn in a thread of its own
(`hisparse/server/engine_loop.py` says why). SIGINT and SIGTERM shut down within --graceful-shutdown-timeout
(`GracefulShutdown`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

PROG = "python -m hisparse.launch_server"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    from hisparse.server.args import check_port_free, fail, parse_args

    try:
        args = parse_args(argv, prog)
    except SystemExit as done:  # --help, or a flag argparse refused (it has printed the one line)
        return int(done.code or 0)
    try:
        config = args.engine_config()
        from hisparse.models.loader import resolve_model_path

        resolve_model_path(config.model)
        if config.tp_size > 1 and args.disaggregation_mode != "null":
            raise ValueError("tp_size > 1 with --disaggregation-mode is not implemented: one rank per instance")
        if config.node_rank > 0:
            return run_ranks(config)
        check_port_free(args.host, args.port)
        if args.disaggregation_mode == "prefill":
            check_port_free(args.host, args.disaggregation_bootstrap_port)
    except (ValueError, FileNotFoundError) as error:
        return fail(prog, str(error))
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("hisparse.server")
    from hisparse.server.args import is_loopback

    if args.api_key is None and not is_loopback(args.host):
        log.warning("listening on %s without --api-key: anyone who reaches the port can use the server", args.host)

    import uvicorn

    from hisparse.engine.llm_engine import LLMEngine
    from hisparse.server.api_server import create_app
    from hisparse.server.engine_loop import EngineLoop

    log.info("loading %s", config.model or "the default model")
    try:
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError) as error:
        return fail(prog, str(error))
    if not args.skip_server_warmup:
        from hisparse.engine.warm_up import warm_up_in_place

        log.info("warming up (one short request; its tokens are not counted in /metrics)")
        if not warm_up_in_place(engine):
            log.warning("no warm-up: the device budget cannot hold a request past the hot buffer")
    engine_loop = EngineLoop(engine)
    try:
        disaggregation = disaggregation_role(args, engine_loop)
    except (ValueError, RuntimeError) as error:
        return fail(prog, str(error))
    app = create_app(engine_loop, args.model_name(), args.max_queued_requests, args.api_key, args.max_request_bytes,
                     disaggregation)
    grace = args.graceful_shutdown_timeout
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=grace + 5))  # a backstop for uvicorn's own wait
    http = threading.Thread(target=_serve_http, args=(server, engine_loop), name="hisparse-http")
    shutdown = GracefulShutdown(server, engine_loop, grace, log)
    for signum in (signal.SIGINT, signal.SIGTERM):  # uvicorn listens to signals only in the main thread
        signal.signal(signum, shutdown.handle)
    log.info("serving %r on http://%s:%d/v1 (HiSparse %s%s)", args.model_name(), args.host, args.port,
             "on" if config.enable_hisparse else "off",
             "" if disaggregation is None else f", {args.disaggregation_mode} instance")
    try:
        engine_loop.run(on_running=http.start)
        http.join()
    finally:
        engine.close()
    if not server.started:
        return fail(prog, f"could not serve on {args.host}:{args.port}; uvicorn's reason is logged above")
    return 0


def run_ranks(config) -> int:
    """--node-rank N > 0: this machine's ranks of rank 0's engine, no server; the exit status is theirs."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ranks = config.node_ranks
    logging.getLogger("hisparse.server").info("node %d: ranks %d-%d, meeting rank 0 at %s", config.node_rank,
                                              ranks[0], ranks[-1], config.dist_init_addr)
    from hisparse.engine.workers import run_node

    return run_node(config)


def disaggregation_role(args, engine_loop):
    """This server's part in prefill-decode disaggregation (None: it serves requests whole); its transfer engine
    listens on the server's host."""
    if args.disaggregation_mode == "null":
        return None
    import socket

    from hisparse.disaggregation.transfer_engine import KVTransferEngine

    host = {"localhost": "127.0.0.1", "0.0.0.0": None, "::": None}.get(args.host, args.host)
    host = host or socket.gethostbyname(socket.gethostname())  # an address the other instance can reach
    transfer = KVTransferEngine(host)
    if args.disaggregation_mode == "prefill":
        from hisparse.server.pd_prefill import PrefillInstance

        return PrefillInstance(engine_loop, transfer, args.host, args.disaggregation_bootstrap_port,
                               args.disaggregation_timeout)
    from hisparse.server.pd_decode import DecodeRooms

    return DecodeRooms(engine_loop, transfer, args.disaggregation_timeout)


class GracefulShutdown:
    """The first SIGTERM or SIGINT: new requests get 503 at once, uvicorn stops accepting connections, and the
    running requests may go on for `grace` seconds; then the engine loop aborts them (a stream closes with an
    error event, a plain request gets a 503), frees their memory and ends, and the process exits. A second
    signal exits at once."""

    def __init__(self, server, engine_loop, grace: float, log: logging.Logger) -> None:
        self.server = server
        self.engine_loop = engine_loop
        self.grace = grace
        self.log = log
        self.signalled = False

    def handle(self, signum: int, frame) -> None:
        if self.signalled:
            self.log.warning("second %s: exiting at once", signal.Signals(signum).name)
            os._exit(128 + signum)
        self.signalled = True
        running = self.engine_loop.stats().get("running", 0)
        self.log.info("%s: shutting down; %d running requests have %.0f s to finish", signal.Signals(signum).name,
                      running, self.grace)
        self.engine_loop.drain()
        self.server.handle_exit(signum, frame)
        timer = threading.Timer(self.grace, self.engine_loop.stop)
        timer.daemon = True
        timer.start()


def _serve_http(server, engine_loop) -> None:
    """uvicorn's whole life; when it ends, however (a shutdown stops the loop already, a failed start does not),
    the engine loop ends too."""
    try:
        server.run()
    finally:
        engine_loop.stop()


if __name__ == "__main__":
    sys.exit(main())
