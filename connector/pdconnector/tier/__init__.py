"""A host-memory tier of KV blocks beside vLLM's own cache, keyed by vLLM's block hashes
(docs/design/kv-offload.md)."""
