"""kvpool's per-node sidecar daemon: tiered block store, local API and peer transfers."""
