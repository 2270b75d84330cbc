"""The background work of the leader, the one process among all replicas that holds the
maintenance lease (lease.py): the sweeps, one module each (rescue.py, expiry.py, purge.py), and
its log of why tasks wait (waits.py); beside them, in every process, the replica's overrides of
the kill switch and the cap (overrides.py). run.py is the loop that runs them all.
"""
