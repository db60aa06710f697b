"""The KV connector vLLM loads (``kv_connector_module_path: pdconnector.vllm.connector``, class
``PDConnector``).

The only package that imports vLLM. ``config`` (the ``--kv-transfer-config`` shape), ``scheduler``
(which requests move which blocks, when blocks are freed), ``worker`` (per TP rank: hands work to
the background transfer worker, reports results), ``kv_layout`` (vLLM's KV cache -> layout model
and registered regions, checked), ``metadata`` (what the scheduler ships to the workers each step).
"""
