"""How the coordinator is served: its process, HTTPS reloading certificates, a deadline on request headers."""
