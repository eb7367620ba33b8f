"""Code shared by the eopd services: settings loading, model loading, tokenizer fingerprints, the
table of logit transforms (`logits`) and the generated `eopd.v1` protobuf modules. Nothing here
does work at import time."""

__version__ = "0.1.0"
