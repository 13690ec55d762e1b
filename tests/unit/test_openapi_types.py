"""openapi.json is generated from the types that decode the request bodies (issue 15, item 5)."""

from __future__ import annotations

import inspect
import re

import msgspec

from omni.api.errors import ErrorResponse
from omni.api.images import ImageRoutes
from omni.api.protocol import SCHEMA_EXTRA
from omni.api.control import ControlRoutes
from omni.api.jobs import Jobs
from omni.api.routes import ROUTES, openapi_spec
from omni.api.speech import SpeechRoutes
from omni.api.text import TextRoutes
from omni.api.videos import VideoRoutes
from omni.api.voices import VoiceRoutes

FAMILIES = {"text": TextRoutes, "speech": SpeechRoutes, "images": ImageRoutes, "videos": VideoRoutes, "voices": VoiceRoutes,
            "control": ControlRoutes, "jobs": Jobs}


def test_each_body_schema_is_the_type_its_handler_decodes():
    bodies = [r for r in ROUTES if r.body is not None]
    assert {r.path for r in bodies} >= {"/v1/chat/completions", "/v1/completions", "/v1/audio/speech"}
    for r in bodies:
        family = FAMILIES[r.family]
        source = inspect.getsource(getattr(family, r.handler))
        # a route may decode in a method its jobs' check shares (parse, chat_request ...): read those too
        for name in set(re.findall(r"self\.(\w+)\(", source)):
            if callable(getattr(family, name, None)):
                source += inspect.getsource(getattr(family, name))
        assert "decode_body(" in source and r.body.__name__ in source, (r.path, r.body)
    spec = openapi_spec("m")
    _, components = msgspec.json.schema_components([r.body for r in bodies] + [ErrorResponse],
                                                   ref_template="#/components/schemas/{name}")
    for name, extra in SCHEMA_EXTRA.items():
        components[name].update(extra)
    assert spec["components"]["schemas"] == components
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"presence_penalty", "logit_bias", "min_tokens", "logprobs", "messages"} <= set(chat)
    assert spec["paths"]["/v1/audio/voices/{name}"]["delete"]
    assert spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ChatCompletionRequest"}
