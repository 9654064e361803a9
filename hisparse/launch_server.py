"""`python -m hisparse.launch_server --port 30000 [--enable-hisparse ...]`: the OpenAI-compatible server.

Flags are checked (and the port tried) before the model loads, so mistakes fail in a second with one line.
"""

from __future__ import annotations

import logging
import sys

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

    import uvicorn

    from hisparse.engine.llm_engine import LLMEngine
    from hisparse.server.api_server import create_app
    from hisparse.server.engine_loop import EngineLoop

    log.info("loading %s", config.model or "the default model")
    try:
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError) as error:
        return fail(prog, str(error))
    app = create_app(EngineLoop(engine), args.model_name(), args.max_queued_requests)
    log.info("serving %r on http://%s:%d/v1 (HiSparse %s)", args.model_name(), args.host, args.port,
             "on" if config.enable_hisparse else "off")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
