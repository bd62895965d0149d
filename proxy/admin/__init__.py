"""The admin HTTP API (SPEC.md, "Admin API"): an ASGI app served by hypercorn on Trio."""

from proxy.admin.app import AdminApp
from proxy.admin.serve import serve_admin

__all__ = ["AdminApp", "serve_admin"]
