"""The orchestrator's API front: requests in (gRPC ``Generator``, the OpenAI-compatible HTTP API), text out.

It validates and tokenizes requests (``requests``, ``limits``, ``tools``), turns each into generations
(``generation``, ``samples``), detokenizes and streams what the decode engine commits (``detok``), and
serves it (``servicer``, ``openai_server``, ``server``). It reaches the services only through
``specsplit.orchestrator.decode``.
"""
