"""Pre-flight: what a job's settings and this environment would do to it, said before it runs."""
