"""The certificate authority: a private CA, certificates for the hub, each site and each person, site kits.

Owns the CA and certificate files (tls.py) and a site's kit (site_kit.py); the commands that use
them are coordinator/cli/tls.py's (`cardiofl coordinator tls ...`), and serving HTTPS with them is
coordinator/serving/tls.py's. It may import the coordinator's configuration and errors; it knows
nothing of studies, rounds, sites, storage or the API, and none of them imports it.
"""
