"""``dsa serve``: the OpenAI-compatible HTTP server (needs the ``serve`` extra: FastAPI, uvicorn).

Binds 127.0.0.1 by default; logs one line per request; SIGTERM or Ctrl-C shut it down cleanly
(requests in flight get up to ``--shutdown-timeout`` seconds, then are aborted).
"""
import importlib.util
import logging
import os

from dsa.commands.options import add_model_arguments, llm_from_args
from dsa.model.presets import PRESETS


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install -e '.[serve]')")
    add_model_arguments(p)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a random-weight preset with the byte-level tokenizer "
                   "instead of a checkpoint (default: the embedded default model, demo-gpu on CUDA, demo-cpu else)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    p.add_argument("--api-key", default=os.environ.get("DSA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DSA_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the checkpoint folder's "
                   "name, or dsa-default)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, help="seconds requests in flight get at "
                   "shutdown (default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"dsa serve: needs {' and '.join(missing)}; install the extra with "
                         "pip install 'deepseek-sparse-attention[serve]'")
    import uvicorn

    from dsa.serve.engine_loop import EngineLoop
    from dsa.serve.openai_server import build_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    llm = llm_from_args(args)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
                                      else f"dsa-{args.preset}" if args.preset else "dsa-default")
    app = build_app(llm, EngineLoop(llm.engine), name, args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
