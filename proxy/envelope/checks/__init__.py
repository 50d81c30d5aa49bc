"""The checks of the envelope, one module per check (see `proxy.envelope.pipeline.CHECKS`)."""
