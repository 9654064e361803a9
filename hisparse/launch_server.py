"""`python -m hisparse.launch_server --port 30000 [--enable-hisparse ...]`: the OpenAI-compatible server.

Flags are checked (and the port tried) before the model loads, so mistakes fail in a second with one line.
The engine loop runs in the main thread, which loaded the model, and uvicorn in a thread of its own
(`hisparse/server/engine_loop.py` says why). SIGINT and SIGTERM tell uvicorn to shut down, which stops the loop.
"""

from __future__ import annotations

import logging
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
        check_port_free(args.host, args.port)
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
    app = create_app(engine_loop, args.model_name(), args.max_queued_requests, args.api_key, args.max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    http = threading.Thread(target=_serve_http, args=(server, engine_loop), name="hisparse-http")
    for signum in (signal.SIGINT, signal.SIGTERM):  # uvicorn listens to signals only in the main thread
        signal.signal(signum, server.handle_exit)
    log.info("serving %r on http://%s:%d/v1 (HiSparse %s)", args.model_name(), args.host, args.port,
             "on" if config.enable_hisparse else "off")
    engine_loop.run(on_running=http.start)
    http.join()
    if not server.started:
        return fail(prog, f"could not serve on {args.host}:{args.port}; uvicorn's reason is logged above")
    return 0


def _serve_http(server, engine_loop) -> None:
    """uvicorn's whole life; when it ends, however (a shutdown stops the loop already, a failed start does not),
    the engine loop ends too."""
    try:
        server.run()
    finally:
        engine_loop.stop()


if __name__ == "__main__":
    sys.exit(main())
