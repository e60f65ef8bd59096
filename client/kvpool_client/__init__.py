"""kvpool's client library: block keys, the local wire format and the sidecar client."""
