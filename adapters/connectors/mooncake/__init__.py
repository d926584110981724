"""The optional ``mooncake`` connector: payloads through Mooncake's transfer engine."""
