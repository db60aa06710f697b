"""pd-operator data plane: KV layout, transfer protocol, transports, vLLM connector, router and mock
engine."""
