"""The resilience lab: prove a job survives each fault (:mod:`.run`), replay its observed
failures under other settings (:mod:`.whatif`), and run one fault plan on every engine side by side
(:mod:`.compare`)."""
