"""The site's approval page: `cardiofl site ui` serves it on 127.0.0.1 (site_agent/ui/server.py)."""
