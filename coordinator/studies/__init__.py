"""Studies: creation, start / pause / resume / cancel (lifecycle.py), what is shown (views.py), gauges (gauges.py).

Surveys and evaluations (job_kinds.py: their creation and start) run no rounds: their sites, and a
training study's validation sites, do jobs instead (jobs.py: what a site is due; reports.py: what it
reports; job_results.py: what researchers read of them).

It may import the rounds room (a started study opens its first round), sites, storage, the base
modules and shared/; only the API and the commands import it.
"""
