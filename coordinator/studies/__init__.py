"""Studies: creation, start / pause / resume / cancel (lifecycle.py), what is shown (views.py), gauges (gauges.py).

It may import the rounds room (a started study opens its first round), sites, storage, the base
modules and shared/; only the API and the commands import it.
"""
