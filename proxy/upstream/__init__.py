"""Upstream side: the forwarder seam, the lean HTTP transport, upstream health."""
