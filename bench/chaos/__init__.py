"""A chaos soak: real processes under load while faults land, and a checker over what clients saw.

    python -m specsplit.bench.chaos --json bench/results/chaos.json --duration-s 1800 [--seed 7 --clients 12]

Target, draft and orchestrator run as processes on loopback, the draft behind an emulated link
(``specsplit.bench.netem``). Clients stream greedy and seeded sampling requests (COUPLED, so a seed's
tokens are fixed) from a fixed catalogue while a fault schedule drawn from a seed (``schedule``)
kills and restarts services, stalls and slows the draft link, cancels streams, sends malformed and
oversize requests, and drains and restarts the orchestrator. ``checker`` then holds the history
against the promises: every completed generation has exactly its fault-free reference's tokens,
every failure has a documented status and never contradicted a token it had streamed, no stream
outlived its deadline, no session leaked, RSS stayed flat. ``--hosts`` runs it across hosts built in the
machine with pools of replicas (``stack``), adding partitions of a replica's host.
"""
