"""The push/pull transfer protocol, pure logic shared by the transfer worker, the vLLM connector and the mock
engine.

``params`` (router <-> engine request parameters), ``messages`` (wire format of the
notifications), ``rendezvous`` (prefill side: pairing, attempts, leases), ``completion`` (decode
side: counting completions, the fence), ``liveness`` (how long the fence lasts, from the probe that
kills a frozen engine), ``timeline`` (a transfer's milestones and the stages between them), ``pull``
(prefill's holds of blocks exposed for a remote READ). No I/O, no clocks: callers pass ``now``.

The one rule every state machine here keeps: **a block registered for a remote WRITE, or exposed for a
remote READ, goes back to the engine only when the peer can no longer touch it.**

Push, one transfer, per (prefill rank, decode rank)::

    decode  RECEIVING ──completions from every writer──────────────────────────────▶ finished
              │ deadline / cancel / a writer's FailureMessage
              ▼
            FENCED ──AbortMessage to writers not yet quiet
              │ every writer quiet (completed, or its FailureMessage), or its engine gone (+grace),
              │ or the fence (liveness.fence_seconds) past the deadline
              ▼
            failed: the engine may reuse the blocks

    prefill WAITING (blocks or registration) ──both halves, registration within its lifetime──▶ WRITING
              │ lease / lifetime / abort / cancel / pairing error           │ written, failed, or
              ▼                                                            ▼ cancel confirmed
            ENDING (no new WRITE; in-flight ones drain or stay pinned) ─────▶ CLOSED: FailureMessage to
                                                                               decode (nothing in flight),
                                                                               blocks freed, tombstone

Pull: decode READs within what is left of prefill's hold (``params.REMOTE_HOLD_KEY``, counted from the
request's arrival at decode); a READ it cannot cancel keeps decode's blocks until it ends; only then is
prefill told to free (``AbortMessage``) or told it is done (the READ's ``ReadDoneMessage``).
"""
