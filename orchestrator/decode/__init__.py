"""The orchestrator's decode engine: a generation's rounds over the draft and target services.

``loop`` runs the rounds, ``policy`` decides each one, ``links`` carry them out over ``peers`` (a
stream per session, or every session on one ``mux`` stream), ``replies`` are what the services answer,
and ``grammar`` fits blocks to a structured output's grammar. Token ids in, token ids out: no
detokenizing, no request formats (those are ``specsplit.orchestrator.api``'s).
"""
