"""Where each served request's prompt tokens came from, counted once per request.

The scheduler side plans the split when vLLM allocates a request's blocks (vLLM's prefix cache, the KV
tier, prefill over the transfer, the engine's own forward); what fails afterwards moves tokens to where they
really came from (a tier load that failed on a rank, a receive that vLLM recomputed). A request that finished
normally is counted in the first stats vLLM collects after it: vLLM frees a step's finished requests before
it hands the connector that step's worker reports, so a failure reported in that step still corrects its
count. A request that ended otherwise (aborted, or failed: under the ``fail`` policy a failed receive) counts
nothing."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdconnector.vllm.stats import TokenSource

# the tokens vLLM counts as the connector's (external) hits
EXTERNAL_SOURCES = frozenset({TokenSource.TIER, TokenSource.REMOTE})

TokenSplit = dict[TokenSource, int]


class PromptTokens:
    """Each live request's planned split, and the served requests' splits not yet counted."""

    def __init__(self) -> None:
        self._planned: dict[str, TokenSplit] = {}  # allocated, not finished
        self._finished: dict[str, TokenSplit] = {}  # finished normally, not yet counted

    def plan(self, request_id: str, tokens: Mapping[TokenSource, int]) -> None:
        """The split planned at allocation; a request allocated again (preempted) replaces its plan."""
        self._planned[request_id] = dict(tokens)

    def external(self, request_id: str) -> TokenSplit:
        """The planned external tokens, by source (what vLLM was told it would get from the connector)."""
        tokens = self._planned.get(request_id, {})
        return {source: count for source, count in tokens.items() if source in EXTERNAL_SOURCES and count}

    def moved(self, request_id: str, sources: Iterable[TokenSource], to: TokenSource) -> None:
        """The tokens planned from ``sources`` came from ``to`` instead."""
        tokens = self._planned.get(request_id, self._finished.get(request_id))
        if tokens is not None:
            moved = sum(tokens.pop(source, 0) for source in sources)
            tokens[to] = tokens.get(to, 0) + moved

    def finished(self, request_id: str, *, served: bool) -> None:
        """The request ended; ``served``: normally (counted at the next :meth:`take`), else never counted."""
        tokens = self._planned.pop(request_id, None)
        if tokens is not None and served:
            self._finished[request_id] = tokens

    def take(self) -> dict[str, TokenSplit]:
        """The finished requests' splits, each once."""
        taken, self._finished = self._finished, {}
        return taken
