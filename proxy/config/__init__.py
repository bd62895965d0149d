"""Configuration: the line-aware YAML loader, typed validation helpers, and ``proxy.yaml``.

Every error a config file can cause is a :class:`proxy.errors.ConfigError` that names
the file, the line and the dotted key (``FILE:LINE: KEY: message``), as SPEC.md fixes
for ``run`` and ``rules check``.
"""
