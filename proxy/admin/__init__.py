"""The admin HTTP API (SPEC.md, "Admin API"): an ASGI app served by hypercorn on Trio.

:class:`~proxy.admin.app.AdminApp` is the app (no trio); :func:`proxy.admin.serve.serve_admin`
serves it (the Trio edge), imported from its module.
"""

from proxy.admin.app import AdminApp

__all__ = ["AdminApp"]
