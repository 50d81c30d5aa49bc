"""Metrics (declared once) and, later, traces; the envelope imports this, never `proxy.admin`."""
