"""Tool calling: the functions a chat offers its model (spec.py), the model's way of writing a
call (hermes.py), a conversation with calls and their results made ready for a chat template
(conversation.py), and a reply's calls sent as they are generated (stream.py)."""

from spanserve.tools.spec import Function, Reply, ToolCall, Tools, ToolsError

__all__ = ["Function", "Reply", "ToolCall", "Tools", "ToolsError"]
