"""Storage: blobs (global models, phi_0, updates) in the database or a file store, read window by window.

Owns the blob store (blob_store.py), putting and reading blobs (blobs.py, blob_cache.py), summing
stored updates without holding one whole (stored_updates.py), and releasing what settled rounds no
longer need (retention.py). It may import the coordinator's base (models, db, errors) and shared/;
it knows nothing of rounds, studies, sites or HTTP.
"""
