"""OpenAI-compatible (and SGLang /generate) request models, error bodies, and response/SSE-chunk builders."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from runtime.sampling_params import SamplingParams

MAX_N = 16  # choices per request at most; the server expands n into n engine requests
MAX_TOP_LOGPROBS = 20

# ---------------------------------------------------------------- errors


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ProtocolError(Exception):
    """An error the server answers with `status` and `error_body(...)`."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def _fail(param: str, message: str) -> PydanticCustomError:
    # Cross-field checks run in model validators, whose errors carry an empty loc; `param` (relative to
    # the model being validated) goes in ctx so that validation_error_to_body can still name the field.
    return PydanticCustomError("invalid_request", "{message}", {"param": param, "message": message})


def _param(loc: Sequence[str | int], fields: set[str]) -> str:
    # Keep fields and indices; drop dict keys and the union-member tags pydantic puts in loc ("list[int]").
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in fields:
            out += f".{part}" if out else part
    return out


def validation_error_to_body(exc: pydantic.ValidationError) -> dict:
    """The OpenAI error body for a failed request validation; `param` names the most specific bad field."""
    fields = {f.alias or name for model in _ALL_MODELS for name, f in model.model_fields.items()}
    errors = exc.errors(include_url=False)
    if not errors:
        return error_body(str(exc))
    deepest = max(errors, key=lambda e: len(e["loc"]))
    ctx_param = deepest.get("ctx", {}).get("param")
    param = _param(list(deepest["loc"]) + ([ctx_param] if ctx_param else []), fields) or None
    if deepest["type"] == "missing":
        return error_body(f"Missing required parameter: '{param}'.", param=param)
    # A union mismatch reports once per member ("a valid string", "a valid list"); say them all.
    same = [e["msg"].removeprefix("Value error, ") for e in errors
            if _param(e["loc"], fields) == _param(deepest["loc"], fields)]
    msgs = [m[:1].lower() + m[1:] for m in dict.fromkeys(same)]
    msg = " or ".join([msgs[0]] + [m.removeprefix("input should be ") for m in msgs[1:]])
    got = repr(deepest["input"])
    if ctx_param is None and len(got) <= 80:  # a cross-field check's input is the whole request
        msg += f" (got {got})"
    return error_body(f"Invalid '{param}': {msg}." if param else f"Invalid request: {msg}.", param=param)


# ---------------------------------------------------------------- requests


class _Model(BaseModel):
    # strict: "0.7" is no number and 1 is no bool, as in the OpenAI API. extra: unknown fields are ignored.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):  # clients send `"temperature": null` for "unset"
            f = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in f or f[k].default is None}
        return data


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # assistant may carry only tool_calls
            raise _fail("content", f"a '{self.role}' message needs content")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Model):
    include_usage: bool = False


class JsonSchema(_Model):
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise _fail("json_schema", "response_format type 'json_schema' needs a 'json_schema' object")
        return self


_Penalty = Annotated[float, Field(ge=-2, le=2)]
_Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _SamplingRequest(_Model):
    """Fields common to chat and completions: OpenAI's, then SGLang's extras."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None  # OpenAI refuses it without stream; we ignore it then
    stop: str | list[str] | None = None
    seed: _Seed | None = None
    frequency_penalty: _Penalty = 0.0
    presence_penalty: _Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    top_k: int = Field(-1, ge=-1)  # -1 or 0: off
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is not None and any(s == "" for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"key {key!r} is not a token id (keys are token ids written as strings)")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias {bias} for token {key} is outside [-100, 100]")
        return v


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # accepted and ignored
    tool_choice: str | dict[str, Any] | None = None  # accepted and ignored
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _cross_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _fail("top_logprobs", "top_logprobs needs logprobs set to true")
        return self


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # OpenAI caps at 5; we allow 20
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _cross_checks(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and (not self.prompt or any(p in ("", []) for p in self.prompt)):
            raise _fail("prompt", "prompt must not be an empty list or hold empty prompts")
        if self.max_tokens == 0 and not self.echo:
            raise _fail("max_tokens", "max_tokens must be >= 1 (0 only with echo, to score the prompt)")
        if self.suffix:
            raise _fail("suffix", "suffix is not supported (no fill-in-the-middle)")
        if self.best_of is not None and self.best_of != self.n:
            raise _fail("best_of", f"best_of={self.best_of} is not supported unless it equals n={self.n}")
        return self


class GenerateRequest(_Model):
    """SGLang's native `/generate` body: exactly one of text and input_ids."""

    text: str | list[str] | None = None
    input_ids: list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0)
    stream: bool = False
    rid: str | list[str] | None = None

    @field_validator("sampling_params")
    @classmethod
    def _known_params(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            SamplingParams.from_dict(v)
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise _fail("text", "give exactly one of 'text' and 'input_ids'")
        if self.text == [] or self.input_ids == [] or [] in (self.input_ids or ()):
            raise _fail("text" if self.text is not None else "input_ids", "the prompt must not be empty")
        return self


_ALL_MODELS = (TextPart, ChatMessage, StreamOptions, JsonSchema, ResponseFormat, ChatCompletionRequest,
               CompletionRequest, GenerateRequest)

# ---------------------------------------------------------------- requests -> engine


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages for the chat template: text parts joined with newlines."""
    return [{"role": m.role, "content": m.text, **({"name": m.name} if m.name else {})} for m in req.messages]


def completion_prompts(req: CompletionRequest) -> list[str] | list[list[int]]:
    """The batch of prompts; choice j of prompt i is choice index i * n + j in the response."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    return [p] if isinstance(p[0], int) else p  # type: ignore[list-item,return-value]


def _sampling_params(req: _SamplingRequest, max_new: int | None, max_name: str,
                     max_context_remaining: int | None, prompt_param: str) -> dict[str, Any]:
    if max_context_remaining is not None:
        if max_context_remaining <= 0 and max_new != 0:
            raise ProtocolError("the prompt fills the model's context; no room is left for a completion",
                                param=prompt_param)
        if max_new is None:
            max_new = max_context_remaining
        elif max_new > max_context_remaining:
            raise ProtocolError(f"{max_name}={max_new} exceeds the {max_context_remaining} tokens the prompt "
                                "leaves in the model's context", param=max_name)
    if max_new is not None and req.min_tokens > max_new:
        raise ProtocolError(f"min_tokens={req.min_tokens} exceeds {max_name}={max_new}", param="min_tokens")
    d: dict[str, Any] = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k if req.top_k > 0 else -1,
        "min_p": req.min_p, "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty, "repetition_penalty": req.repetition_penalty,
        "min_new_tokens": req.min_tokens,
        "stop": (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()), "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens, "seed": req.seed,
        "logit_bias": {int(k): float(v) for k, v in (req.logit_bias or {}).items()},
    }
    if max_new is not None:
        d["max_new_tokens"] = max_new
    return d


def chat_sampling_params(req: ChatCompletionRequest, max_context_remaining: int | None) -> dict[str, Any]:
    """SamplingParams.from_dict input. No max_completion_tokens/max_tokens: up to `max_context_remaining`
    (the context left after the prompt; None: leave max_new_tokens out, for the caller to fill). Raises
    ProtocolError if the request asks for more than is left or for min_tokens above the maximum."""
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return _sampling_params(req, getattr(req, name), name, max_context_remaining, "messages")


def completion_sampling_params(req: CompletionRequest, max_context_remaining: int | None) -> dict[str, Any]:
    """As chat_sampling_params; max_tokens defaults to 16 (OpenAI's default) and may be 0 with echo."""
    return _sampling_params(req, req.max_tokens, "max_tokens", max_context_remaining, "prompt")


def response_format_dict(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """The engine's `response_format` (scheduler/grammar.py compiles it); None for plain text."""
    rf = req.response_format
    return None if rf is None or rf.type == "text" else rf.model_dump(by_alias=True, exclude_none=True)


def resolve_n_seeds(seed: int | None, n: int) -> list[int | None]:
    """Per-choice seeds: seed + i for choice i (reproducible yet distinct choices), or all None."""
    return [None] * n if seed is None else [seed + i for i in range(n)]


def logprob_args(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """Engine.generate's return_logprob, top_logprobs_num, logprob_start_len (0 with echo: prompt too)."""
    if isinstance(req, ChatCompletionRequest):
        return {"return_logprob": req.logprobs, "top_logprobs_num": req.top_logprobs or 0,
                "logprob_start_len": -1}
    on = req.logprobs is not None
    return {"return_logprob": on, "top_logprobs_num": req.logprobs or 0,
            "logprob_start_len": 0 if on and req.echo else -1}


# ---------------------------------------------------------------- engine -> responses


def openai_finish_reason(internal: dict | None) -> str | None:
    """{"type": "stop"|"length"} -> "stop"|"length"; None (still running) -> None.

    Raises ProtocolError(503, server_error, code "request_aborted") for {"type": "abort"}: OpenAI has no
    finish reason for it, and reporting "stop" would pass truncated output off as complete. The server
    answers it as an error response, or as an SSE error event when streaming has begun."""
    if internal is None:
        return None
    kind = internal.get("type")
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise ProtocolError(f"request aborted: {internal.get('message') or 'aborted'}", status=503,
                            type="server_error", code="request_aborted")
    raise ValueError(f"unknown finish reason {internal!r}")


def response_id(prefix: str) -> str:
    """A fresh id: response_id("chatcmpl") or response_id("cmpl")."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(tokens: Sequence[str], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[str, float]]] | None = None) -> dict:
    """Chat `logprobs` of a choice or chunk; `top[i]` are position i's (token, logprob) alternatives."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(*alt) for alt in (top[i] if top else ())]}
                        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True))]}


def completion_logprobs(tokens: Sequence[str], logprobs: Sequence[float | None],
                        top: Sequence[Sequence[tuple[str, float]] | None] | None = None,
                        text_offset: int = 0) -> dict:
    """Completions `logprobs`; offsets count characters from `text_offset` (the length of text before)."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {"tokens": list(tokens), "token_logprobs": list(logprobs), "text_offset": offsets,
            "top_logprobs": None if top is None else [None if x is None else dict(x) for x in top]}


def chat_choice(index: int, content: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_completion_response(id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage}


def chat_chunk(id: str, model: str, created: int, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
    """One SSE chunk; `delta` is {"role": "assistant", "content": ""} first, then {"content": piece}."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage}


def completion_chunk(id: str, model: str, created: int, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


def usage_chunk(id: str, model: str, created: int, usage: dict, chat: bool = True) -> dict:
    """The last chunk under stream_options.include_usage: no choices, the whole request's usage."""
    return {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}
