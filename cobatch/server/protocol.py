"""The OpenAI API subset cobatch serves: request, response and stream-chunk shapes, and the error body.

Requests forbid unknown fields (an unknown field may change behaviour: silently ignoring it would
answer a different question) and non-finite numbers. Well-known fields that change nothing here
(`user`, `store`, `metadata`, ...) are accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_N = 32
MAX_TOOLS = 128  # OpenAI's bound on `tools`


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- errors ------------------------------------------------------------------------------------------

class ErrorInfo(_Response):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """Every non-2xx body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


# ---- shared request fields ---------------------------------------------------------------------------

class StreamOptions(_Request):
    """`stream_options`: a final usage chunk when include_usage."""

    include_usage: bool = False


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` extension: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class _SamplingRequest(_Request):
    """Fields common to completions and chat completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # cobatch's: end the request this many ms after its arrival (finish_reason "deadline"), and refuse
    # it at once (429 deadline_unreachable) when its first token is predicted later. The header
    # x-cobatch-deadline-ms sets one too; with both, the tighter applies (docs/SERVER.md).
    deadline_ms: float | None = Field(None, gt=0.0)
    # Structured outputs (docs/SERVER.md): OpenAI's response_format, vLLM's structured_outputs and its
    # legacy guided_* fields; at most one of them.
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: they change nothing about the answer.
    user: str | None = Field(None, max_length=512)
    store: bool | None = None
    metadata: dict[str, str] | None = None


# ---- completions -------------------------------------------------------------------------------------

class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extension: the top logprobs of every prompt position, in vLLM's shape (choices[i].prompt_logprobs).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class CompletionLogprobs(_Response):
    """Completions-shaped logprobs: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's Logprob: a token's logprob at one prompt position, its rank (1: the most likely), its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(_Response):
    """One choice of a completion (or of a completion stream chunk)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With the prompt_logprobs extension (vLLM's shape): per prompt token (None for the first), the
    # prompt token and the top alternatives by token id.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class PromptTokensDetails(_Response):
    """OpenAI's usage.prompt_tokens_details: of the prompt tokens, those the prefix cache served."""

    cached_tokens: int


class Usage(_Response):
    """Token counts: prompt once, completion summed over the n choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionResponse(_Response):
    """Non-stream /v1/completions answer; also the shape of each stream chunk (object differs)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- chat completions --------------------------------------------------------------------------------

class TextContentPart(_Request):
    """A text part of a message's content (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    """A function call an earlier assistant message made: its name and its arguments as JSON text."""

    name: str = Field(max_length=256)
    arguments: str


class ToolCallParam(_Request):
    """One tool call of an earlier assistant message (answered by a "tool" message with its id)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message of a conversation (a "tool" message answers an assistant's tool call by id)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallParam] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    """A function the model may call: `parameters` is a JSON schema of its arguments object."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # only the declared properties, every one required (OpenAI's)


class ChatTool(_Request):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    """The function a named tool_choice forces."""

    name: str = Field(max_length=64)


class NamedToolChoice(_Request):
    """tool_choice {"type": "function", "function": {"name": ...}}: call exactly that function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TopLogprob(_Response):
    """One alternative at a position (chat shape)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at a position and its top alternatives (chat shape)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    """Chat-shaped logprobs."""

    content: list[ChatTokenLogprob] | None = None


class FunctionCallOutput(_Response):
    """A generated call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Response):
    """One tool call of the generated message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOutput


class AssistantMessage(_Response):
    """The generated message (content null when it is only tool calls; tool_calls left out if none)."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(_Response):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    """Non-stream /v1/chat/completions answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class _DropNone(_Response):
    """A stream shape whose unset fields are left out, as OpenAI does."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    """A tool call's piece in one chunk: the name in its first, then fragments of the arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """One tool call's part of a chunk; `index` says which call, id and type come in its first."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_DropNone):
    """What a chat stream chunk adds to one choice (unset fields are left out, as OpenAI does)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    """One choice in a chat stream chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    """One SSE chunk of a chat stream (choices empty in the final usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- models, tokenize --------------------------------------------------------------------------------

class ModelCard(_Response):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "cobatch"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """POST /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(_Response):
    """The token ids of a prompt."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


class DetokenizeResponse(_Response):
    """The text of some token ids."""

    prompt: str
