"""Worker-side serving shared by the roles: the engine thread, the OpenAI API, metrics, the common app."""
