"""The open-files limit of a process that holds many connections: raised to what the system allows.

A gateway holds a descriptor for every SSE stream, long poll, feed poll and download in
progress, and a tenant may hold up to ``max_streams`` of them (SPEC §13: 10 000 by
default). Linux starts a process at a soft limit of 1 024 while allowing far more (the hard
limit, often 524 288): at 1 024, one tenant's thousand streams used up the descriptors and
every other tenant's requests were refused at ``accept()``. Raising the soft limit is what
nginx's ``worker_rlimit_nofile`` does; the hard limit is the operator's to set.
"""

from __future__ import annotations

import resource

# What "no limit" becomes: setrlimit refuses RLIM_INFINITY for RLIMIT_NOFILE above fs.nr_open.
UNLIMITED_AS = 1 << 20


def raise_open_files_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_AS if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # above fs.nr_open: keep what we have
            pass
    return soft
