"""The resilience lab: prove a job survives each fault (:mod:`.run`), and replay its observed
failures under other settings (:mod:`.whatif`)."""
