"""What the ``/v1/responses`` tests on a worker and on ``pd-serve`` share: a function tool and a JSON schema small
enough for stories260K."""

from __future__ import annotations

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "mood": {"enum": ["happy", "sad"]}},
          "required": ["name", "mood"], "additionalProperties": False}
