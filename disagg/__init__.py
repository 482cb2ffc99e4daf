"""What the prefill and decode roles share beyond the HTTP layer: the ``/prefill`` call between them
(`prefill_api`) and how a KV-transfer failure is answered over HTTP (`errors`).

The two roles never import each other; both import this package. It imports the engine (`SamplingParams`),
the transfer (tickets, errors) and `serving` (`HTTPError`), and neither role.
"""
