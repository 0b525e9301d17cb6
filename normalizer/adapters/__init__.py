"""Route adapters: a registry from route name to a fresh, versioned adapter.

`get_adapter(route)` returns a new adapter instance (adapters keep
per-attempt state, so every attempt gets its own); `adapter_version(route)`
is what ingest stamps on its records. An unknown route raises StreamError
with reason UNKNOWN_ROUTE.
"""

from __future__ import annotations

from collections.abc import Callable

from callgate.errors import Reason, StreamError

from normalizer.adapters.anthropic_messages import AnthropicMessagesAdapter
from normalizer.adapters.base import Adapter
from normalizer.adapters.openai_chat import OpenAIChatAdapter
from normalizer.adapters.openai_responses import OpenAIResponsesAdapter

__all__ = ["Adapter", "ROUTES", "adapter_version", "get_adapter"]

ROUTES: dict[str, Callable[[str], Adapter]] = {
    "openai-responses": OpenAIResponsesAdapter,
    "cometapi-responses": OpenAIResponsesAdapter,
    "anthropic-messages": AnthropicMessagesAdapter,
    "openai-chat": OpenAIChatAdapter,
}


def get_adapter(route: str) -> Adapter:
    try:
        factory = ROUTES[route]
    except KeyError:
        raise StreamError(Reason.UNKNOWN_ROUTE, "route not registered") from None
    return factory(route)


def adapter_version(route: str) -> str:
    return get_adapter(route).version
