"""Helpers that several test folders use: a coordinator served on a socket, a proxy that cuts connections."""
