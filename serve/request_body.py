"""A request body as JSON, before any model sees it: depth, lone surrogates and syntax checked, with
OpenAI-shaped errors (ProtocolError, 400)."""

from __future__ import annotations

import json
import re
from typing import Any

from serve.openai_protocol import ProtocolError

MAX_JSON_DEPTH = 64  # nesting of a request body (a chat request is ~5 deep; deeper ones overflow parsers)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object. Raises ProtocolError (400) for invalid JSON, anything but an object,
    nesting deeper than MAX_JSON_DEPTH, and lone UTF-16 surrogates (JSON allows the escapes, but no UTF-8
    text can hold them), naming the field where it can."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProtocolError("the request body is not valid JSON") from None
    except RecursionError:
        raise ProtocolError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(data, dict):
        raise ProtocolError("the request body must be a JSON object")
    check_surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if check_surrogates and _has_lone_surrogate(value):
                raise ProtocolError(f"Invalid '{path or 'body'}': the string holds a lone UTF-16 surrogate",
                                    param=path or None)
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                field = re.split(r"[.\[]", path, maxsplit=1)[0]
                raise ProtocolError(f"Invalid '{field}': nested more than {MAX_JSON_DEPTH} levels deep",
                                    param=field)
            if isinstance(value, dict):
                for key, item in value.items():
                    if check_surrogates and _has_lone_surrogate(key):
                        raise ProtocolError(f"Invalid '{path or 'body'}': a key holds a lone UTF-16 "
                                            "surrogate", param=path or None)
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
            else:
                stack += [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    return data


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
