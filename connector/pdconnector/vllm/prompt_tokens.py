"""Where each request's prompt tokens came from, counted once per request and only once it is settled.

The scheduler side plans the split when vLLM allocates a request's blocks (vLLM's prefix cache, the KV tier,
prefill over the transfer, the engine's own forward); what fails afterwards moves tokens to where they really
came from (a tier load that failed on a rank, a receive that failed). A request is counted in the first stats
vLLM collects after it finished: vLLM frees a step's finished requests before it hands the connector that
step's worker reports, so a failure reported in the step a request ended still corrects its count."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdconnector.vllm.stats import TokenSource

# the tokens vLLM counts as the connector's (external) hits
EXTERNAL_SOURCES = frozenset({TokenSource.TIER, TokenSource.REMOTE})

Split = dict[TokenSource, int]


class PromptTokens:
    def __init__(self) -> None:
        self._planned: dict[str, Split] = {}  # allocated, not finished
        self._finished: dict[str, Split] = {}  # finished, not yet counted

    def plan(self, request_id: str, tokens: Mapping[TokenSource, int]) -> None:
        """The split planned at allocation; a request allocated again (preempted) replaces its plan."""
        self._planned[request_id] = dict(tokens)

    def external(self, request_id: str) -> Split:
        """The planned external tokens, by source (what vLLM was told it would get from the connector)."""
        tokens = self._planned.get(request_id, {})
        return {source: count for source, count in tokens.items() if source in EXTERNAL_SOURCES and count}

    def moved(self, request_id: str, sources: Iterable[TokenSource], to: TokenSource | None) -> None:
        """The tokens planned from ``sources`` came from ``to`` instead; ``to`` None: the request was not
        served, and counts nothing."""
        for split in (self._planned, self._finished):
            tokens = split.get(request_id)
            if tokens is None:
                continue
            if to is None:
                del split[request_id]
                return
            moved = sum(tokens.pop(source, 0) for source in sources)
            tokens[to] = tokens.get(to, 0) + moved
            return

    def finished(self, request_id: str) -> None:
        if (tokens := self._planned.pop(request_id, None)) is not None:
            self._finished[request_id] = tokens

    def take(self) -> dict[str, Split]:
        """The finished requests' splits, each once."""
        taken, self._finished = self._finished, {}
        return taken
