"""The NIXL connector (docs/connectors.md, "nixl")."""
