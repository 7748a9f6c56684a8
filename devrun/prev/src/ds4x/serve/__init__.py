"""OpenAI-compatible HTTP server (``ds4x serve``); see :mod:`ds4x.serve.app`."""

from ds4x.serve.app import create_app

__all__ = ["create_app"]
