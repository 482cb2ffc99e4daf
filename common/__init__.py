"""What every layer shares, below all of them: command-line flag tables (`flags`), TCP port picking (`net`),
OpenAI's error types (`openai_errors`) and a quick exit for servers that have shut down (`process`).

Standard library only, and no import of any other pd-cluster package: the router, the KV transfer and
``pd-bench`` use it without torch.
"""
