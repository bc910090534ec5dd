"""HTTP server: the live verify page and its JSON API (create_app)."""

from .app import create_app

__all__ = ["create_app"]
