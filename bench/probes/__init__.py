"""One-off measurements behind a decision (bench/probes/RESULTS.md), each run as
``python bench/probes/<name>.py`` from the repository root."""
