"""What crosses the network as JSON: plain pydantic models, no torch, below the math that fills them.

- protocol: a site and its coordinator (tasks, offers, approvals, declines, updates, errors);
- secure: the phases of a secure round (advertisements, shares, reveals, the round view);
- urls: the API paths both sides derive.
"""
