"""Studies: creation with validated terms, start / pause / resume / cancel (lifecycle.py), and what is shown (views.py).

It may import the rounds room (a started study opens its first round), sites, storage, the base
modules and shared/; only the API and the commands import it.
"""
