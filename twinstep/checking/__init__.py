"""Checking: the tie of one gradient step (`tie`) and of whole training steps (`trajectory`),
their bounds (`bounds`) and inputs (`inputs`); the op library's oracles and certification
(`oracle`, `certification`); parity with timm + torch (`parity`)."""
