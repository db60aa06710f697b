"""The push/pull transfer protocol, pure logic shared by the transfer worker, the vLLM connector and the mock engine.

``params`` (router <-> engine request parameters), ``messages`` (wire format of the
notifications), ``rendezvous`` (prefill side: pairing, attempts, leases), ``completion`` (decode
side: counting completions, prompt failure). No I/O, no clocks: callers pass ``now``.
"""
