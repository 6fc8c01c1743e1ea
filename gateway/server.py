"""`voxpipe gateway`: the OpenAI-compatible HTTP API (and realtime WebSocket, and the Converse
gRPC API when built) in front of the Thinker, Talker and Code2Wav services."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.util
import logging
import os

from voxpipe.errors import ConfigError
from voxpipe.services.runtime.listen import HOST_HELP, bind_http, check_free, default_host, port_number
from voxpipe.services.runtime.tls import TLSConfigError, add_client_tls_arguments

from .cors import ENV as CORS_ENV, OriginsError, origins_flag
from .limits import DEFAULT_ADMISSION_WAIT_S, DEFAULT_AUDIO_CACHE_MB, MAX_PROMPT_CHARS, REALTIME_TURN_HOLD_S

log = logging.getLogger(__name__)


def megabytes(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of MB, at least 0, got {text!r}")
    return value


def non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds, at least 0, got {text[:40]!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    replicas = ("comma-separated replicas: host:port, or dns:///name:port for every address of a name "
                "(re-resolved as replicas come and go; see voxpipe.services.runtime.balancer)")
    parser.add_argument("--thinker", default="127.0.0.1:50051", help=f"the thinker: {replicas}")
    parser.add_argument("--code2wav", default="127.0.0.1:50053",
                        help=f"code2wav, where spoken replies are read from: {replicas}; the talkers' --code2wav "
                             "must name the same replicas (the talkers pick one, the gateway attaches to it)")
    parser.add_argument("--model", help="checkpoint folder or Hugging Face repo id (Org/Name[@REV]) for the "
                                        "tokenizer, config and feature extractor (default: the tiny checkpoint)")
    parser.add_argument("--served-model-name", help="the model id clients use (default: --model's repo id, or "
                                                    "the checkpoint folder name)")
    parser.add_argument("--host", default=default_host(), help=HOST_HELP + " -- HTTP and Converse")
    parser.add_argument("--http-port", type=port_number, default=8000,
                        help="the OpenAI HTTP API, realtime WebSocket and /metrics port (0: any free port)")
    parser.add_argument("--grpc-port", type=port_number, default=0, help="serve the Converse gRPC API here (0: off)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on HTTP, WebSocket "
                                                        "and Converse (default: $VOXPIPE_API_KEY; unset: no auth)")
    parser.add_argument("--max-sessions", type=int, default=0,
                        help="a hard cap: concurrent generations, realtime and Converse sessions before 429 (default "
                             "0: none; spoken generations are admitted by capacity, see --admission-wait)")
    parser.add_argument("--admission-wait", type=non_negative_seconds, default=DEFAULT_ADMISSION_WAIT_S,
                        help="seconds a spoken generation waits for the stages to have capacity (no stream they "
                             "serve under 500 ms of audio ahead of its listener) before 429 "
                             f"(default {DEFAULT_ADMISSION_WAIT_S:g}; 0: refuse at once)")
    parser.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body (413 above)")
    parser.add_argument("--body-timeout", type=float, default=60.0,
                        help="seconds a request body may take to arrive completely (408 after)")
    parser.add_argument("--max-prompt-chars", type=int, default=MAX_PROMPT_CHARS,
                        help="characters of text in one conversation, checked before tokenizing (400 above)")
    parser.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=False,
                        help="serve gRPC server reflection on the Converse port (off unless asked for; "
                             "`voxpipe up` turns it on)")
    parser.add_argument("--audio-expiry", type=int, default=3600,
                        help="seconds an assistant audio id stays usable in later turns")
    parser.add_argument("--audio-cache-mb", type=megabytes, default=DEFAULT_AUDIO_CACHE_MB,
                        help="log-mel features of chat input_audio clips kept by the clip's content (SHA-256 of "
                             "its bytes), least recently used dropped first: a conversation re-sending a clip is "
                             f"not decoded again (default {DEFAULT_AUDIO_CACHE_MB:g}; 0: off)")
    parser.add_argument("--realtime-turn-hold", type=non_negative_seconds, default=REALTIME_TURN_HOLD_S,
                        help="seconds a committed realtime user turn keeps the thinker request it was streamed to "
                             "(and the KV blocks it prefilled) waiting for response.create; released after, or as "
                             "soon as the conversation changes under it, the turn is sent whole when answered "
                             f"(default {REALTIME_TURN_HOLD_S:g}; 0: released at the commit)")
    parser.add_argument("--constrain-tool-calls", action=argparse.BooleanOptionalAction, default=False,
                        help="with tools and tool_choice 'auto' (chat, realtime, Converse), constrain the thinker's "
                             "sampling inside each <tool_call> block the model opens to a valid call of one of the "
                             "tools (free text outside them); default off: 'auto' is unconstrained")
    add_cors_argument(parser)
    g = parser.add_argument_group("TLS (serving)")
    g.add_argument("--ssl-certfile", default=os.environ.get("VOXPIPE_SSL_CERTFILE") or None,
                   help="PEM certificate chain: serve HTTPS, WSS and TLS on the Converse port (with --ssl-keyfile; "
                        "env VOXPIPE_SSL_CERTFILE; default: plaintext)")
    g.add_argument("--ssl-keyfile", default=os.environ.get("VOXPIPE_SSL_KEYFILE") or None,
                   help="PEM private key of --ssl-certfile (env VOXPIPE_SSL_KEYFILE)")
    add_client_tls_arguments(parser, who="the thinker and code2wav")


def add_cors_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cors-allow-origins", type=origins_flag, default=None, metavar="ORIGINS",
                        help="browser pages on these origins may call the HTTP API (CORS) and open the realtime "
                             "WebSocket: a comma-separated list of scheme://host[:port], or '*' for any (env "
                             f"{CORS_ENV}; default: none, only pages the gateway serves itself, like the console "
                             "at /). Clients that send no Origin header (SDKs, curl) are never refused")


async def serve(args) -> None:
    import uvicorn

    from voxpipe.services.thinker.prompt import FeatureConfigError

    from .app import create_app
    from .config import GatewayConfig

    try:
        config = GatewayConfig.from_args(args)
    except (TLSConfigError, OriginsError) as e:
        raise ConfigError(str(e)) from None
    check_free("gateway Converse gRPC", config.host, config.grpc_port, "--grpc-port")   # before the model loads
    sock = bind_http("gateway HTTP", config.host, config.http_port, "--http-port")
    try:
        app = create_app(config)
    except FeatureConfigError as e:      # the model folder's audio front end disagrees with its config
        raise ConfigError(str(e)) from None
    # the imports and the app live as long as the process (`run` starts with the collector off):
    # frozen out of its generations, collections while serving and the one at exit skip them
    gc.freeze()
    gc.enable()
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.http_port, loop="none",
                                           http="auto", ws="auto", log_level=args.log_level.lower(),
                                           # logs in voxpipe's format (logs.py), the access lines its own
                                           log_config=None, access_log=False, timeout_graceful_shutdown=10,
                                           ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if serving.done():  # failed to start (port taken ...): surface the error
        await serving
        raise SystemExit(1)
    converse = await _start_converse(app.state.gateway, config)
    port = server.servers[0].sockets[0].getsockname()[1]
    log.info("gateway serving model %r (%s)", config.model_id, config.model_dir)
    print(f"gateway ready on port {port}" + (" (https)" if config.tls else ""), flush=True)
    try:
        await serving
    finally:
        if converse is not None:
            await converse.stop(5.0)


async def _start_converse(state, config):
    """The Converse gRPC API, when gateway/converse.py provides `serve_converse(app_state, port, host)`
    (it starts the server on this loop and returns it; `await server.stop(grace)` stops it)."""
    port = config.grpc_port
    if not port:
        return None
    name = "voxpipe.gateway.converse"
    serve_converse = getattr(importlib.import_module(name), "serve_converse", None) \
        if importlib.util.find_spec(name) else None
    if serve_converse is None:
        log.warning("--grpc-port %d given but this build has no Converse API; ignoring it", port)
        return None
    return await serve_converse(state, port, config.host)


def run(args) -> None:
    from voxpipe.services.runtime.tracing import setup_tracing

    setup_tracing("voxpipe-gateway")
    if args.model is None:
        from voxpipe.cli import default_model_dir

        args.model = str(default_model_dir())
    from voxpipe.services.runtime.checkpoint import hub_name, resolve_model

    args.served_model_name = args.served_model_name or hub_name(args.model)    # a repo id, not the cache folder
    args.model = str(resolve_model(args.model, weights=False))     # config, tokenizer, feature extractor
    if not getattr(args, "api_key", None):
        args.api_key = os.environ.get("VOXPIPE_API_KEY") or None
    gc.disable()     # until `serve` has built the app: ~1 s less CPU at start
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))
