from voxpipe.v1 import stages_pb2 as _stages_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_TEXT: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]

class ResponseFormatType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESPONSE_FORMAT_TEXT: _ClassVar[ResponseFormatType]
    RESPONSE_FORMAT_JSON_OBJECT: _ClassVar[ResponseFormatType]
    RESPONSE_FORMAT_JSON_SCHEMA: _ClassVar[ResponseFormatType]

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_AUTO: _ClassVar[ToolChoice]
    TOOL_CHOICE_NONE: _ClassVar[ToolChoice]
    TOOL_CHOICE_REQUIRED: _ClassVar[ToolChoice]
MODALITY_UNSPECIFIED: Modality
MODALITY_TEXT: Modality
MODALITY_AUDIO: Modality
RESPONSE_FORMAT_TEXT: ResponseFormatType
RESPONSE_FORMAT_JSON_OBJECT: ResponseFormatType
RESPONSE_FORMAT_JSON_SCHEMA: ResponseFormatType
TOOL_CHOICE_AUTO: ToolChoice
TOOL_CHOICE_NONE: ToolChoice
TOOL_CHOICE_REQUIRED: ToolChoice

class Pcm16Audio(_message.Message):
    __slots__ = ("data", "sample_rate")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sample_rate: int
    def __init__(self, data: _Optional[bytes] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class AudioInput(_message.Message):
    __slots__ = ("pcm16", "wav")
    PCM16_FIELD_NUMBER: _ClassVar[int]
    WAV_FIELD_NUMBER: _ClassVar[int]
    pcm16: Pcm16Audio
    wav: bytes
    def __init__(self, pcm16: _Optional[_Union[Pcm16Audio, _Mapping]] = ..., wav: _Optional[bytes] = ...) -> None: ...

class ConverseStart(_message.Message):
    __slots__ = ("request_id", "instructions", "audio", "text", "voice", "output_modalities", "sampling", "max_tokens", "min_tokens", "max_frames", "min_frames", "ignore_eos", "audio_encoding", "stop", "logprobs", "top_logprobs", "tools", "tool_choice", "single_tool_call", "history", "tool_function", "response_format")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MODALITIES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_ENCODING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    SINGLE_TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    TOOL_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instructions: str
    audio: _containers.RepeatedCompositeFieldContainer[AudioInput]
    text: str
    voice: str
    output_modalities: _containers.RepeatedScalarFieldContainer[Modality]
    sampling: _stages_pb2.Sampling
    max_tokens: int
    min_tokens: int
    max_frames: int
    min_frames: int
    ignore_eos: bool
    audio_encoding: _stages_pb2.AudioEncoding
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    tools: _containers.RepeatedCompositeFieldContainer[FunctionTool]
    tool_choice: ToolChoice
    single_tool_call: bool
    history: _containers.RepeatedCompositeFieldContainer[HistoryItem]
    tool_function: str
    response_format: ResponseFormat
    def __init__(self, request_id: _Optional[str] = ..., instructions: _Optional[str] = ..., audio: _Optional[_Iterable[_Union[AudioInput, _Mapping]]] = ..., text: _Optional[str] = ..., voice: _Optional[str] = ..., output_modalities: _Optional[_Iterable[_Union[Modality, str]]] = ..., sampling: _Optional[_Union[_stages_pb2.Sampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., audio_encoding: _Optional[_Union[_stages_pb2.AudioEncoding, str]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[FunctionTool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, str]] = ..., single_tool_call: _Optional[bool] = ..., history: _Optional[_Iterable[_Union[HistoryItem, _Mapping]]] = ..., tool_function: _Optional[str] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "name", "schema_json", "strict")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    type: ResponseFormatType
    name: str
    schema_json: str
    strict: bool
    def __init__(self, type: _Optional[_Union[ResponseFormatType, str]] = ..., name: _Optional[str] = ..., schema_json: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class FunctionTool(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class FunctionCall(_message.Message):
    __slots__ = ("call_id", "name", "arguments_json")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    name: str
    arguments_json: str
    def __init__(self, call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class HistoryItem(_message.Message):
    __slots__ = ("user_text", "assistant_text", "function_call", "function_output")
    USER_TEXT_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_TEXT_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_CALL_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    user_text: str
    assistant_text: str
    function_call: FunctionCall
    function_output: FunctionOutput
    def __init__(self, user_text: _Optional[str] = ..., assistant_text: _Optional[str] = ..., function_call: _Optional[_Union[FunctionCall, _Mapping]] = ..., function_output: _Optional[_Union[FunctionOutput, _Mapping]] = ...) -> None: ...

class FunctionOutput(_message.Message):
    __slots__ = ("call_id", "output")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    output: str
    def __init__(self, call_id: _Optional[str] = ..., output: _Optional[str] = ...) -> None: ...

class ToolCallOutput(_message.Message):
    __slots__ = ("index", "call")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    index: int
    call: FunctionCall
    def __init__(self, index: _Optional[int] = ..., call: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "call_id", "name", "arguments_delta")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_DELTA_FIELD_NUMBER: _ClassVar[int]
    index: int
    call_id: str
    name: str
    arguments_delta: str
    def __init__(self, index: _Optional[int] = ..., call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_delta: _Optional[str] = ...) -> None: ...

class ConverseRequest(_message.Message):
    __slots__ = ("start", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: ConverseStart
    cancel: _stages_pb2.Cancel
    def __init__(self, start: _Optional[_Union[ConverseStart, _Mapping]] = ..., cancel: _Optional[_Union[_stages_pb2.Cancel, _Mapping]] = ...) -> None: ...

class TextOutput(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_stages_pb2.TokenLogprob]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_stages_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "audio_frames", "audio_samples", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    audio_frames: int
    audio_samples: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., audio_frames: _Optional[int] = ..., audio_samples: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class ConverseDone(_message.Message):
    __slots__ = ("request_id", "text_finish", "audio_finish", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FINISH_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FINISH_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text_finish: _stages_pb2.FinishReason
    audio_finish: _stages_pb2.FinishReason
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., text_finish: _Optional[_Union[_stages_pb2.FinishReason, str]] = ..., audio_finish: _Optional[_Union[_stages_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ConverseError(_message.Message):
    __slots__ = ("code", "message", "stage")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    stage: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., stage: _Optional[str] = ...) -> None: ...

class ConverseResponse(_message.Message):
    __slots__ = ("text", "audio", "done", "error", "tool_call", "tool_call_delta")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTA_FIELD_NUMBER: _ClassVar[int]
    text: TextOutput
    audio: _stages_pb2.AudioChunk
    done: ConverseDone
    error: ConverseError
    tool_call: ToolCallOutput
    tool_call_delta: ToolCallDelta
    def __init__(self, text: _Optional[_Union[TextOutput, _Mapping]] = ..., audio: _Optional[_Union[_stages_pb2.AudioChunk, _Mapping]] = ..., done: _Optional[_Union[ConverseDone, _Mapping]] = ..., error: _Optional[_Union[ConverseError, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCallOutput, _Mapping]] = ..., tool_call_delta: _Optional[_Union[ToolCallDelta, _Mapping]] = ...) -> None: ...
