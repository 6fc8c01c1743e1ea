"""The gateway's settings (from the command line of `voxpipe gateway`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from voxpipe.services.runtime.tls import ClientTLS, ServerTLS, client_tls_from_args

from .cors import AllowedOrigins, origins_from_env
from .limits import DEFAULT_ADMISSION_WAIT_S, DEFAULT_AUDIO_CACHE_MB, MAX_PROMPT_CHARS, REALTIME_TURN_HOLD_S


@dataclass(frozen=True)
class GatewayConfig:
    thinker: str                       # host:port[,host:port...] (replicas)
    code2wav: str                      # the replicas audio may come from (the talkers' --code2wav set)
    model_dir: str                     # tokenizer, config.json, feature extractor (for rendering prompts)
    model_id: str = ""                 # the id clients send as `model` (default: the checkpoint folder name)
    host: str = "127.0.0.1"            # every listener: HTTP / WebSocket and Converse
    http_port: int = 8000
    grpc_port: int = 0                 # the Converse gRPC API (0: off)
    api_key: str | None = None         # when set, every /v1 request and every Converse call needs
                                       # `Authorization: Bearer <key>` (header or gRPC metadata)
    max_sessions: int = 0              # hard cap: concurrent HTTP generations, realtime and Converse sessions before 429 (0: none)
    admission_wait_s: float = DEFAULT_ADMISSION_WAIT_S   # a spoken generation's wait for capacity before 429 (admission.py)
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout_s: float = 60.0       # a request body must arrive completely within this time (408)
    max_prompt_chars: int = MAX_PROMPT_CHARS   # text of one conversation, checked before tokenizing
    reflection: bool = False           # gRPC server reflection on the Converse port
    audio_expiry_s: int = 3600         # how long an assistant audio id stays usable in later turns
    max_stored_audio: int = 10000      # transcripts kept for multi-turn audio references
    audio_cache_bytes: int = int(DEFAULT_AUDIO_CACHE_MB * 2**20)   # chat clips' features kept by content (0: off)
    realtime_turn_hold_s: float = REALTIME_TURN_HOLD_S   # a committed realtime turn's stream waits for response.create
    ssl_certfile: str | None = None    # serve HTTPS / WSS and TLS on Converse with this PEM chain ...
    ssl_keyfile: str | None = None     # ... and key (both or neither)
    tls: ServerTLS | None = None       # the same pair, read (for the Converse gRPC port)
    stage_tls: ClientTLS | None = None # how the thinker and code2wav replicas are dialled (None: plaintext)
    cors_allow_origins: AllowedOrigins = AllowedOrigins()   # browser pages elsewhere that may call the API
    constrain_tool_calls: bool = False # tool_choice 'auto': each <tool_call> block constrained to a valid call

    def __post_init__(self) -> None:
        if not self.model_id:
            path = Path(self.model_dir)
            object.__setattr__(self, "model_id", path.stem if path.is_file() else path.name)

    @classmethod
    def from_args(cls, args) -> "GatewayConfig":
        """The config of the command line; TLSConfigError (naming the flags) for half-given TLS,
        OriginsError for a malformed $VOXPIPE_CORS_ALLOW_ORIGINS (the flag is checked by argparse)."""
        certfile, keyfile = getattr(args, "ssl_certfile", None), getattr(args, "ssl_keyfile", None)
        tls = ServerTLS.from_files(certfile, keyfile, flags=("--ssl-certfile", "--ssl-keyfile", ""))
        return cls(thinker=args.thinker, code2wav=args.code2wav, model_dir=str(args.model),
                   model_id=args.served_model_name or "", host=args.host, http_port=args.http_port,
                   grpc_port=args.grpc_port or 0, api_key=args.api_key or os.environ.get("VOXPIPE_API_KEY") or None,
                   max_sessions=args.max_sessions, admission_wait_s=args.admission_wait, max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                   body_timeout_s=args.body_timeout, max_prompt_chars=args.max_prompt_chars,
                   reflection=args.reflection, audio_expiry_s=args.audio_expiry,
                   audio_cache_bytes=int(args.audio_cache_mb * 2**20),
                   realtime_turn_hold_s=args.realtime_turn_hold,
                   ssl_certfile=certfile if tls else None, ssl_keyfile=keyfile if tls else None, tls=tls,
                   stage_tls=client_tls_from_args(args),
                   cors_allow_origins=getattr(args, "cors_allow_origins", None) or origins_from_env(),
                   constrain_tool_calls=bool(getattr(args, "constrain_tool_calls", False)))
