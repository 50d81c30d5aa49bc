"""Engines of the offline commands: policy tests (`envelope-proxy test`) and replay."""
