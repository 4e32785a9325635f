"""Training: the configuration (`config`), the loop (`loop`), its evaluation (`evaluation`),
checkpoints (`checkpoint`), logs (`run_log`), and timm state dicts in and out (`state_dict`)."""
