"""How the coordinator is served: its server process (process) and HTTPS that reloads certificates (tls)."""
