from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    UINT16: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
    CANCELLED: _ClassVar[FinishReason]

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    AUDIO_PCM16: _ClassVar[AudioEncoding]
    AUDIO_FLOAT32: _ClassVar[AudioEncoding]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
INT64: DType
INT32: DType
UINT16: DType
BOOL: DType
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason
CANCELLED: FinishReason
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
AUDIO_PCM16: AudioEncoding
AUDIO_FLOAT32: AudioEncoding

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PayloadChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "prompt_tokens", "completion_tokens", "samples", "cached_tokens", "streamed_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    samples: int
    cached_tokens: int
    streamed_tokens: int
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., samples: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., streamed_tokens: _Optional[int] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids", "packed")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    packed: bytes
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., packed: _Optional[bytes] = ...) -> None: ...

class ContextExceeded(_message.Message):
    __slots__ = ("prompt_tokens", "reply_tokens", "context_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    reply_tokens: int
    context_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., reply_tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class ThinkerStart(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "audio_features", "sampling", "max_tokens", "min_tokens", "talker_rows", "speech", "stop", "logprobs", "top_logprobs", "assistant_text", "constraint", "unspoken_tool_calls", "stream_audio")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TALKER_ROWS_FIELD_NUMBER: _ClassVar[int]
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_TEXT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    UNSPOKEN_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    STREAM_AUDIO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: TokenIds
    text: str
    audio_features: _containers.RepeatedCompositeFieldContainer[Tensor]
    sampling: Sampling
    max_tokens: int
    min_tokens: int
    talker_rows: bool
    speech: SpeechParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    assistant_text: str
    constraint: Constraint
    unspoken_tool_calls: bool
    stream_audio: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., audio_features: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., talker_rows: _Optional[bool] = ..., speech: _Optional[_Union[SpeechParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., assistant_text: _Optional[str] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., unspoken_tool_calls: _Optional[bool] = ..., stream_audio: _Optional[bool] = ...) -> None: ...

class AudioFrames(_message.Message):
    __slots__ = ("log_mel",)
    LOG_MEL_FIELD_NUMBER: _ClassVar[int]
    log_mel: Tensor
    def __init__(self, log_mel: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StreamCommit(_message.Message):
    __slots__ = ("log_mel", "start")
    LOG_MEL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    log_mel: Tensor
    start: ThinkerStart
    def __init__(self, log_mel: _Optional[_Union[Tensor, _Mapping]] = ..., start: _Optional[_Union[ThinkerStart, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: bytes
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[bytes] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class SpeechParams(_message.Message):
    __slots__ = ("speaker", "sampling", "max_frames", "min_frames", "code2wav", "text_cap")
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CODE2WAV_FIELD_NUMBER: _ClassVar[int]
    TEXT_CAP_FIELD_NUMBER: _ClassVar[int]
    speaker: str
    sampling: Sampling
    max_frames: int
    min_frames: int
    code2wav: Code2WavParams
    text_cap: TextFrameCap
    def __init__(self, speaker: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., code2wav: _Optional[_Union[Code2WavParams, _Mapping]] = ..., text_cap: _Optional[_Union[TextFrameCap, _Mapping]] = ...) -> None: ...

class TextFrameCap(_message.Message):
    __slots__ = ("frames_per_token", "base_frames")
    FRAMES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BASE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames_per_token: int
    base_frames: int
    def __init__(self, frames_per_token: _Optional[int] = ..., base_frames: _Optional[int] = ...) -> None: ...

class Code2WavParams(_message.Message):
    __slots__ = ("encoding", "first_chunk_frames", "chunk_frames", "echo_frames")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ECHO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    encoding: AudioEncoding
    first_chunk_frames: int
    chunk_frames: int
    echo_frames: bool
    def __init__(self, encoding: _Optional[_Union[AudioEncoding, str]] = ..., first_chunk_frames: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., echo_frames: _Optional[bool] = ...) -> None: ...

class FirstOutput(_message.Message):
    __slots__ = ("stage",)
    STAGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    def __init__(self, stage: _Optional[str] = ...) -> None: ...

class Routed(_message.Message):
    __slots__ = ("stage", "address", "listen_token")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LISTEN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    stage: str
    address: str
    listen_token: str
    def __init__(self, stage: _Optional[str] = ..., address: _Optional[str] = ..., listen_token: _Optional[str] = ...) -> None: ...

class ThinkerRequest(_message.Message):
    __slots__ = ("start", "chunk", "cancel", "audio", "commit")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    start: ThinkerStart
    chunk: PayloadChunk
    cancel: Cancel
    audio: AudioFrames
    commit: StreamCommit
    def __init__(self, start: _Optional[_Union[ThinkerStart, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., audio: _Optional[_Union[AudioFrames, _Mapping]] = ..., commit: _Optional[_Union[StreamCommit, _Mapping]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("index", "token_ids", "text", "embeddings", "logprobs", "more")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    embeddings: Tensor
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    more: bool
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., embeddings: _Optional[_Union[Tensor, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class TalkerPrompt(_message.Message):
    __slots__ = ("user_rows", "user_mm_mask", "user_token_ids", "assistant_head", "assistant_prefix", "tts_special", "audio_rows", "audio_keys", "audio_rows_follow")
    USER_ROWS_FIELD_NUMBER: _ClassVar[int]
    USER_MM_MASK_FIELD_NUMBER: _ClassVar[int]
    USER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_HEAD_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TTS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    AUDIO_ROWS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_KEYS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_ROWS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    user_rows: Tensor
    user_mm_mask: Tensor
    user_token_ids: Tensor
    assistant_head: Tensor
    assistant_prefix: Tensor
    tts_special: Tensor
    audio_rows: Tensor
    audio_keys: _containers.RepeatedScalarFieldContainer[bytes]
    audio_rows_follow: bool
    def __init__(self, user_rows: _Optional[_Union[Tensor, _Mapping]] = ..., user_mm_mask: _Optional[_Union[Tensor, _Mapping]] = ..., user_token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., assistant_head: _Optional[_Union[Tensor, _Mapping]] = ..., assistant_prefix: _Optional[_Union[Tensor, _Mapping]] = ..., tts_special: _Optional[_Union[Tensor, _Mapping]] = ..., audio_rows: _Optional[_Union[Tensor, _Mapping]] = ..., audio_keys: _Optional[_Iterable[bytes]] = ..., audio_rows_follow: _Optional[bool] = ...) -> None: ...

class ThinkerResponse(_message.Message):
    __slots__ = ("talker_prompt", "text", "chunk", "finished", "routed", "talker_finished", "first_output")
    TALKER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    TALKER_FINISHED_FIELD_NUMBER: _ClassVar[int]
    FIRST_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    talker_prompt: TalkerPrompt
    text: TextDelta
    chunk: PayloadChunk
    finished: Finished
    routed: Routed
    talker_finished: Finished
    first_output: FirstOutput
    def __init__(self, talker_prompt: _Optional[_Union[TalkerPrompt, _Mapping]] = ..., text: _Optional[_Union[TextDelta, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., routed: _Optional[_Union[Routed, _Mapping]] = ..., talker_finished: _Optional[_Union[Finished, _Mapping]] = ..., first_output: _Optional[_Union[FirstOutput, _Mapping]] = ...) -> None: ...

class TalkerStart(_message.Message):
    __slots__ = ("request_id", "prompt", "speaker", "sampling", "max_frames", "min_frames", "code2wav", "text_cap")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CODE2WAV_FIELD_NUMBER: _ClassVar[int]
    TEXT_CAP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: TalkerPrompt
    speaker: str
    sampling: Sampling
    max_frames: int
    min_frames: int
    code2wav: Code2WavParams
    text_cap: TextFrameCap
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[TalkerPrompt, _Mapping]] = ..., speaker: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., code2wav: _Optional[_Union[Code2WavParams, _Mapping]] = ..., text_cap: _Optional[_Union[TextFrameCap, _Mapping]] = ...) -> None: ...

class TextRows(_message.Message):
    __slots__ = ("token_ids", "rows", "more")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: Tensor
    more: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., more: _Optional[bool] = ...) -> None: ...

class TextEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AudioRows(_message.Message):
    __slots__ = ("first", "rows")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    first: int
    rows: Tensor
    def __init__(self, first: _Optional[int] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Held(_message.Message):
    __slots__ = ("user_rows", "audio_rows")
    USER_ROWS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_ROWS_FIELD_NUMBER: _ClassVar[int]
    user_rows: int
    audio_rows: int
    def __init__(self, user_rows: _Optional[int] = ..., audio_rows: _Optional[int] = ...) -> None: ...

class TalkerRequest(_message.Message):
    __slots__ = ("start", "rows", "text_end", "chunk", "cancel", "audio_rows")
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TEXT_END_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    AUDIO_ROWS_FIELD_NUMBER: _ClassVar[int]
    start: TalkerStart
    rows: TextRows
    text_end: TextEnd
    chunk: PayloadChunk
    cancel: Cancel
    audio_rows: AudioRows
    def __init__(self, start: _Optional[_Union[TalkerStart, _Mapping]] = ..., rows: _Optional[_Union[TextRows, _Mapping]] = ..., text_end: _Optional[_Union[TextEnd, _Mapping]] = ..., chunk: _Optional[_Union[PayloadChunk, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., audio_rows: _Optional[_Union[AudioRows, _Mapping]] = ...) -> None: ...

class CodecFrames(_message.Message):
    __slots__ = ("index", "codes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    index: int
    codes: Tensor
    def __init__(self, index: _Optional[int] = ..., codes: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Ending(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TalkerResponse(_message.Message):
    __slots__ = ("frames", "finished", "routed", "first_output", "ending", "held")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ENDING_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    frames: CodecFrames
    finished: Finished
    routed: Routed
    first_output: FirstOutput
    ending: Ending
    held: Held
    def __init__(self, frames: _Optional[_Union[CodecFrames, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., routed: _Optional[_Union[Routed, _Mapping]] = ..., first_output: _Optional[_Union[FirstOutput, _Mapping]] = ..., ending: _Optional[_Union[Ending, _Mapping]] = ..., held: _Optional[_Union[Held, _Mapping]] = ...) -> None: ...

class ListenRequest(_message.Message):
    __slots__ = ("listen_token",)
    LISTEN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    listen_token: str
    def __init__(self, listen_token: _Optional[str] = ...) -> None: ...

class Code2WavStart(_message.Message):
    __slots__ = ("request_id", "encoding", "first_chunk_frames", "chunk_frames", "to_listener", "echo_frames", "playback_reports")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TO_LISTENER_FIELD_NUMBER: _ClassVar[int]
    ECHO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PLAYBACK_REPORTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    encoding: AudioEncoding
    first_chunk_frames: int
    chunk_frames: int
    to_listener: bool
    echo_frames: bool
    playback_reports: bool
    def __init__(self, request_id: _Optional[str] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., first_chunk_frames: _Optional[int] = ..., chunk_frames: _Optional[int] = ..., to_listener: _Optional[bool] = ..., echo_frames: _Optional[bool] = ..., playback_reports: _Optional[bool] = ...) -> None: ...

class Playback(_message.Message):
    __slots__ = ("played_seconds", "delivered_seconds")
    PLAYED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    played_seconds: float
    delivered_seconds: float
    def __init__(self, played_seconds: _Optional[float] = ..., delivered_seconds: _Optional[float] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("listen_token",)
    LISTEN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    listen_token: str
    def __init__(self, listen_token: _Optional[str] = ...) -> None: ...

class FramesEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Code2WavRequest(_message.Message):
    __slots__ = ("start", "frames", "frames_end", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_END_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: Code2WavStart
    frames: CodecFrames
    frames_end: FramesEnd
    cancel: Cancel
    def __init__(self, start: _Optional[_Union[Code2WavStart, _Mapping]] = ..., frames: _Optional[_Union[CodecFrames, _Mapping]] = ..., frames_end: _Optional[_Union[FramesEnd, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("sample_offset", "sample_rate", "encoding", "data", "num_samples")
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    sample_offset: int
    sample_rate: int
    encoding: AudioEncoding
    data: bytes
    num_samples: int
    def __init__(self, sample_offset: _Optional[int] = ..., sample_rate: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., data: _Optional[bytes] = ..., num_samples: _Optional[int] = ...) -> None: ...

class Code2WavResponse(_message.Message):
    __slots__ = ("audio", "finished", "accepted", "frames", "ending", "playback")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    ENDING_FIELD_NUMBER: _ClassVar[int]
    PLAYBACK_FIELD_NUMBER: _ClassVar[int]
    audio: AudioChunk
    finished: Finished
    accepted: Accepted
    frames: CodecFrames
    ending: Ending
    playback: Playback
    def __init__(self, audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., frames: _Optional[_Union[CodecFrames, _Mapping]] = ..., ending: _Optional[_Union[Ending, _Mapping]] = ..., playback: _Optional[_Union[Playback, _Mapping]] = ...) -> None: ...
