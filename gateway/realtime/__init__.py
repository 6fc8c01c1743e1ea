"""The realtime voice API (OpenAI's Realtime protocol over a WebSocket, `/v1/realtime`).

- connection.py: the WebSocket route (`router`) and RealtimeConnection, one session: it reads
  client events, keeps the session's state and owns its outbox, response run and transcriber;
- events.py: client events parsed from JSON (and the dialects, GA and beta);
- server_events.py: server events, rendered in the session's dialect; `Emit`, how they are sent;
- session.py: the session's settings, conversation and input audio buffer (no I/O);
- outbox.py: the session's bounded send queue;
- response.py: one response run, given a ResponseContext (what it may use of the session);
- transcription.py: input audio transcription, given a TranscriptionContext;
- vad.py: server VAD (Silero).

The app (gateway/app.py) includes `router` when this package is present."""

from .connection import router

__all__ = ["router"]
