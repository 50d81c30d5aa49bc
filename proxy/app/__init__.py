"""Process lifecycle: runtime wiring, listeners, reload, graceful shutdown."""
