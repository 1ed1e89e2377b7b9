"""Work signals, both halves of one mechanism.

A commit that may give a site work bumps a number every process reads (work); each process wakes its
waiting long-polls when that number moves (waiters).
"""
