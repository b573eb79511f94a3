"""A chat backend that embeds orchestra: one document prefill on the source model, chat sessions on any
family member, and mid-conversation model switches that map the session's KV cache instead of
re-prefilling it. A thin layer over `orchestra.FamilyCache` and `agents.continue_ids`.

Start it with ``python -m examples.chat_backend`` or ``uvicorn examples.chat_backend.app:app``
(from the repository root); see README.md in this folder for the API.
"""

from __future__ import annotations

__all__ = ["ChatConfig", "ChatEngine", "create_app"]


def __getattr__(name: str):
    # Lazy: importing the package must not import starlette or torch.
    if name == "ChatConfig":
        from examples.chat_backend.config import ChatConfig

        return ChatConfig
    if name == "ChatEngine":
        from examples.chat_backend.engine import ChatEngine

        return ChatEngine
    if name == "create_app":
        from examples.chat_backend.app import create_app

        return create_app
    raise AttributeError(f"module 'examples.chat_backend' has no attribute {name!r}")
