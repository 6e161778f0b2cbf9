"""The round policy: what an orchestrator measures (``measure``), the round model (``model``), and each session's decisions (``controller``)."""
