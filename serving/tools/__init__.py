"""OpenAI tool calls, a server concern built on the engine's structured output.

* `spec`: the request's ``tools`` and ``tool_choice`` validated; ``required`` and a named function forced through
  a `StructuredOutput`, and the constrained text turned back into calls.
* `parsers`: ``auto`` calls parsed from free text (``--tool-call-parser``: ``hermes``, ``llama3_json``).
* `stream`: one choice's text deltas turned into OpenAI's streamed tool-call deltas.
* `chat`: the worker's settings (``--enable-auto-tool-choice``) and one chat request's tools, as the OpenAI
  serving code uses them.
"""
